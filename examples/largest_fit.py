"""How long a context fits: `largest_fit` along the sequence, for a small keras-hub Gemma with LoRA.

A `GemmaCausalLM` of 4 blocks of 256 (4 query heads, vocabulary 4096; built
from a config, nothing downloaded) with LoRA of rank 8 on, compiled with Adam
and trained on next tokens, batch 1. `largest_fit` measures what each block
keeps and costs at sequence lengths 64, 128, 192 and 256, fits each figure by
a polynomial in the length (attention's scores grow with its square), measures
once more at the shortest answer (five times 256 away) and fits again, and
reads off the longest sequence whose training step is predicted to fit 512 MiB
with no recompute, each policy, and the budget planner's plan. Nothing runs
at the lengths predicted.

    python examples/largest_fit.py
    KERAS_BACKEND=jax python examples/largest_fit.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main():
    import keras
    import keras_hub
    import numpy as np

    from keras_recompute import largest_fit

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=4096, num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=256,
        intermediate_dim=1024, head_dim=64,
    )
    backbone.enable_lora(8)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def make_inputs(length):  # one sequence of `length` tokens, as the model takes it
        tokens = np.random.RandomState(length).randint(1, 4096, size=(1, length)).astype("int32")
        return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}

    report = largest_fit(model, "512MiB", make_inputs, axis="sequence", multiple_of=64)
    print(report)
    print(f"\nfull recompute: train at sequence length {report.largest('full')}")


if __name__ == "__main__":
    main()
