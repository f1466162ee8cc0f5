"""Integrations with model libraries: `keras_recompute.integrations.bert4keras`."""
