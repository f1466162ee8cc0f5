"""The recompute-enabled layers, built once for each Keras module (Keras 3, tf_keras).

`Dense` and `MultiHeadAttention` subclass the stock layers and only decorate
`call`: same constructor, same weights, same config. `FeedForward` mirrors
bert4keras's `FeedForward` (weights: inner kernel and bias, outer kernel and
bias), and `TransformerBlock` mirrors keras-hub's `TransformerEncoder` (same
constructor arguments, sub-layers created in the same order, so
`set_weights(encoder.get_weights())` works both ways).
"""

import types

from keras_recompute._decorator import recompute_grad

PACKAGE = "keras_recompute"


def _register(K):
    saving = getattr(K, "saving", None)
    if saving is not None and hasattr(saving, "register_keras_serializable"):
        return saving.register_keras_serializable(package=PACKAGE)
    return K.utils.register_keras_serializable(package=PACKAGE)


def build(K):
    """Returns a namespace of the layers subclassing `K.layers`."""
    register = _register(K)
    layers = K.layers

    @register
    class Dense(layers.Dense):
        """`Dense` whose `call` recomputes in the backward pass when recompute is on.

        Same arguments and weights as the stock `Dense`.
        """

        call = recompute_grad(layers.Dense.call)

    @register
    class MultiHeadAttention(layers.MultiHeadAttention):
        """`MultiHeadAttention` whose `call` recomputes when recompute is on.

        Same arguments and weights as the stock layer. Self-attention (the same
        tensor as query, key and value) gets its gradient once.
        """

        call = recompute_grad(layers.MultiHeadAttention.call)

    @register
    class FeedForward(layers.Layer):
        """The transformer feed-forward block: `Dense(units, activation)`, then `Dense(input dim)`.

        Mirrors bert4keras's `FeedForward` (same arguments, same weights in the
        same order), with an optional dropout between the two projections.

        Args:
            units: the inner width (BERT's `intermediate_size`).
            activation: the inner activation.
            use_bias: whether both projections have a bias.
            kernel_initializer: the projections' kernel initializer.
            dropout_rate: dropout on the inner activations (0 for none, as in bert4keras).
        """

        def __init__(
            self,
            units,
            activation="gelu",
            use_bias=True,
            kernel_initializer="glorot_uniform",
            dropout_rate=0.0,
            **kwargs,
        ):
            super().__init__(**kwargs)
            if not isinstance(units, int) or units <= 0:
                raise ValueError(f"keras_recompute: FeedForward(units=...) takes a positive int; received {units!r}.")
            self.units = units
            self.activation = K.activations.get(activation)
            self.use_bias = use_bias
            self.kernel_initializer = K.initializers.get(kernel_initializer)
            self.dropout_rate = dropout_rate
            self.supports_masking = True

        def build(self, input_shape):
            self.inner_dense = layers.Dense(
                self.units,
                activation=self.activation,
                use_bias=self.use_bias,
                kernel_initializer=_clone(self.kernel_initializer),
                dtype=self.dtype_policy,
                name="inner_dense",
            )
            _build(K, self.inner_dense, input_shape)
            self.outer_dense = layers.Dense(
                input_shape[-1],
                use_bias=self.use_bias,
                kernel_initializer=_clone(self.kernel_initializer),
                dtype=self.dtype_policy,
                name="outer_dense",
            )
            _build(K, self.outer_dense, tuple(input_shape[:-1]) + (self.units,))
            self.dropout = layers.Dropout(self.dropout_rate, name="dropout")
            self.built = True

        @recompute_grad
        def call(self, inputs, training=None):
            return self.outer_dense(self.dropout(self.inner_dense(inputs), training=training))

        def compute_output_shape(self, input_shape):
            return input_shape

        def get_config(self):
            config = super().get_config()
            config.update(
                units=self.units,
                activation=K.activations.serialize(self.activation),
                use_bias=self.use_bias,
                kernel_initializer=K.initializers.serialize(self.kernel_initializer),
                dropout_rate=self.dropout_rate,
            )
            return config

    @register
    class TransformerBlock(layers.Layer):
        """A transformer encoder block whose whole `call` recomputes: the unit to checkpoint.

        Self-attention, dropout, residual and layer norm, then feed-forward,
        dropout, residual and layer norm (post-norm, as BERT; `normalize_first`
        for pre-norm). Mirrors keras-hub's `TransformerEncoder`: same
        arguments, same weights in the same order.

        Args:
            intermediate_dim: the feed-forward width.
            num_heads: the number of attention heads (the key size is the
                hidden size divided by it).
            dropout: dropout on attention probabilities and on both residual branches.
            activation: the feed-forward activation.
            layer_norm_epsilon: the layer norms' epsilon (BERT: 1e-12).
            kernel_initializer: the kernels' initializer.
            bias_initializer: the biases' initializer.
            normalize_first: pre-norm instead of post-norm.

        Call arguments:
            inputs: `(batch, length, hidden)`.
            padding_mask: optional `(batch, length)`, true (or 1) for real tokens.
            attention_mask: optional `(batch, length, length)`.
            training: whether dropout is on.
        """

        def __init__(
            self,
            intermediate_dim,
            num_heads,
            dropout=0.0,
            activation="relu",
            layer_norm_epsilon=1e-05,
            kernel_initializer="glorot_uniform",
            bias_initializer="zeros",
            normalize_first=False,
            **kwargs,
        ):
            super().__init__(**kwargs)
            self.intermediate_dim = intermediate_dim
            self.num_heads = num_heads
            self.dropout = dropout
            self.activation = K.activations.get(activation)
            self.layer_norm_epsilon = layer_norm_epsilon
            self.kernel_initializer = K.initializers.get(kernel_initializer)
            self.bias_initializer = K.initializers.get(bias_initializer)
            self.normalize_first = normalize_first
            self.supports_masking = True

        def build(self, inputs_shape):
            hidden_dim = inputs_shape[-1]
            key_dim = int(hidden_dim // self.num_heads)
            if key_dim == 0:
                raise ValueError(
                    f"keras_recompute: TransformerBlock's hidden size {hidden_dim} must be at least "
                    f"num_heads={self.num_heads}."
                )
            dtype = self.dtype_policy
            initializers = dict(
                kernel_initializer=_clone(self.kernel_initializer),
                bias_initializer=_clone(self.bias_initializer),
            )
            self._self_attention_layer = layers.MultiHeadAttention(
                num_heads=self.num_heads,
                key_dim=key_dim,
                dropout=self.dropout,
                dtype=dtype,
                name="self_attention_layer",
                **initializers,
            )
            if hasattr(self._self_attention_layer, "_build_from_signature"):  # tf_keras
                with _name_scope(K, self._self_attention_layer):
                    self._self_attention_layer._build_from_signature(query=inputs_shape, value=inputs_shape)
            else:
                self._self_attention_layer.build(query_shape=inputs_shape, value_shape=inputs_shape)
            self._self_attention_layer_norm = layers.LayerNormalization(
                epsilon=self.layer_norm_epsilon, dtype=dtype, name="self_attention_layer_norm"
            )
            _build(K, self._self_attention_layer_norm, inputs_shape)
            self._self_attention_dropout = layers.Dropout(rate=self.dropout, dtype=dtype, name="self_attention_dropout")
            self._feedforward_layer_norm = layers.LayerNormalization(
                epsilon=self.layer_norm_epsilon, dtype=dtype, name="feedforward_layer_norm"
            )
            _build(K, self._feedforward_layer_norm, inputs_shape)
            self._feedforward_intermediate_dense = layers.Dense(
                self.intermediate_dim,
                activation=self.activation,
                dtype=dtype,
                name="feedforward_intermediate_dense",
                **initializers,
            )
            _build(K, self._feedforward_intermediate_dense, inputs_shape)
            self._feedforward_output_dense = layers.Dense(
                hidden_dim,
                dtype=dtype,
                name="feedforward_output_dense",
                kernel_initializer=_clone(self.kernel_initializer),
                bias_initializer=_clone(self.bias_initializer),
            )
            _build(K, self._feedforward_output_dense, tuple(inputs_shape[:-1]) + (self.intermediate_dim,))
            self._feedforward_dropout = layers.Dropout(rate=self.dropout, dtype=dtype, name="feedforward_dropout")
            self.built = True

        @recompute_grad
        def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
            mask = _merge_masks(K, inputs, padding_mask, attention_mask)
            x = inputs
            residual = x
            if self.normalize_first:
                x = self._self_attention_layer_norm(x)
            x = self._self_attention_layer(query=x, value=x, attention_mask=mask, training=training)
            x = self._self_attention_dropout(x, training=training) + residual
            if not self.normalize_first:
                x = self._self_attention_layer_norm(x)
            residual = x
            if self.normalize_first:
                x = self._feedforward_layer_norm(x)
            x = self._feedforward_output_dense(self._feedforward_intermediate_dense(x))
            x = self._feedforward_dropout(x, training=training) + residual
            if not self.normalize_first:
                x = self._feedforward_layer_norm(x)
            return x

        def compute_output_shape(self, inputs_shape):
            return inputs_shape

        def get_config(self):
            config = super().get_config()
            config.update(
                intermediate_dim=self.intermediate_dim,
                num_heads=self.num_heads,
                dropout=self.dropout,
                activation=K.activations.serialize(self.activation),
                layer_norm_epsilon=self.layer_norm_epsilon,
                kernel_initializer=K.initializers.serialize(self.kernel_initializer),
                bias_initializer=K.initializers.serialize(self.bias_initializer),
                normalize_first=self.normalize_first,
            )
            return config

    return types.SimpleNamespace(
        Dense=Dense,
        MultiHeadAttention=MultiHeadAttention,
        FeedForward=FeedForward,
        TransformerBlock=TransformerBlock,
    )


def _name_scope(K, layer):
    """tf_keras names weights by the name scope they are made in: give each sub-layer its own,
    or two sub-layers' `kernel:0` collide in an `.h5` file. Keras 3 needs none."""
    if hasattr(K, "ops"):
        import contextlib

        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.name_scope(layer.name)


def _build(K, layer, *shapes):
    with _name_scope(K, layer):
        layer.build(*shapes)


def _clone(initializer):
    return initializer.__class__.from_config(initializer.get_config())


def _merge_masks(K, inputs, padding_mask, attention_mask):
    """`(batch, length, length)` boolean mask from a padding mask and an attention mask."""
    ops = getattr(K, "ops", None)
    if ops is None:  # tf_keras
        import tensorflow as ops_tf

        cast, expand, logical_and = ops_tf.cast, ops_tf.expand_dims, ops_tf.logical_and
    else:
        cast, expand, logical_and = ops.cast, ops.expand_dims, ops.logical_and
    mask = None
    if padding_mask is not None:
        mask = expand(cast(padding_mask, "bool"), 1)
    if attention_mask is not None:
        attention_mask = cast(attention_mask, "bool")
        mask = attention_mask if mask is None else logical_and(mask, attention_mask)
    return mask
