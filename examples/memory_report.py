"""Plan to a memory budget, and read the plan: `recompute_model(budget=...)` and `memory_report`.

A keras-hub BERT classifier (4 layers of 256, seq 256, batch 8; built from a
config, nothing downloaded), compiled with Adam. `memory_report` measures what
each block keeps and what its recompute costs under each option, on this
backend at this batch; `recompute_model(budget=...)` chooses, per block, the
least recompute time whose predicted peak fits. The budget here is half-way
between the least any plan reaches and no recompute.

    python examples/memory_report.py
    KERAS_BACKEND=torch python examples/memory_report.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    import keras
    import keras_hub
    import numpy as np

    from keras_recompute import memory_report, recompute_model, recompute_scope

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=8192, num_layers=4, num_heads=4, hidden_dim=256, intermediate_dim=1024, max_sequence_length=256
    )
    pooled = backbone.output["pooled_output"]
    model = keras.Model(backbone.input, keras.layers.Dense(2)(pooled))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = {
        "token_ids": np.random.randint(1, 8192, size=(8, 256)).astype("int32"),
        "segment_ids": np.zeros((8, 256), "int32"),
        "padding_mask": np.ones((8, 256), "int32"),
    }
    before = memory_report(model, batch)
    budget = (before.floor + before.plain_peak) // 2
    print(f"budget: {budget / 1e6:.1f} MB, half-way from the least any plan reaches to no recompute\n")
    recompute_model(model, budget=budget, inputs=batch)
    with recompute_scope(True):  # the report shows the plan as it runs with recompute on
        print(memory_report(model, batch))


if __name__ == "__main__":
    main()
