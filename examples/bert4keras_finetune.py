"""Fine-tune a bert4keras BERT classifier with recompute, on the CPU, in a few minutes.

bert4keras 0.11.5 runs on TensorFlow 2.21 through tf_keras (TF_KERAS=1,
TF_USE_LEGACY_KERAS=1). The BERT here is built from a config (6 layers of 256,
no checkpoint to download) and fine-tuned on a synthetic task: is the
sentence's first word 7 or 8? Four runs, each in its own process with
TensorFlow's BFC allocator, print loss, accuracy and peak memory:

    none     no recompute
    theirs   bert4keras's own recompute (RECOMPUTE=1 when bert4keras is imported):
             per layer, and wrong for self-attention (it doubles the gradient of
             a tensor passed twice): its loss differs
    enable   `keras_recompute.integrations.bert4keras.enable()`: the same layers,
             one by one, exactly
    model    `keras_recompute.recompute_model(model)`: each transformer block as
             one unit (bert4keras builds a block from separate layers; the
             block is found in the graph), exactly

On 2026-12-03 (2-core CPU): none 949 MB, theirs 344 (another loss), enable
313 and model 315 MB, both with none's loss to the last digit.

    python examples/bert4keras_finetune.py

With a real checkpoint, pass `config_path=` and `checkpoint_path=` to
`build_transformer_model` instead of the sizes.
"""

import argparse
import os

os.environ.update(TF_KERAS="1", TF_USE_LEGACY_KERAS="1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


METHOD = "BERT4KERAS_EXAMPLE_METHOD"


def train():
    method = os.environ[METHOD]
    # bert4keras reads RECOMPUTE at its import: on, its own recompute wraps its layers ("theirs"). On TensorFlow
    # 2.21 that wrapper fails to build any model (it calls `tape` functions TensorFlow moved), so the other methods
    # import bert4keras with it off and switch keras_recompute on after (it reads RECOMPUTE when a call runs).
    os.environ["RECOMPUTE"] = "1" if method == "theirs" else "0"
    import numpy as np
    import tensorflow as tf

    if method == "theirs":
        # bert4keras 0.11.5's recompute calls two functions TF 2.21 moved from
        # `tape` to `record` (private TF API, put back for this comparison only).
        from tensorflow.python.eager import record, tape

        for name in ("stop_recording", "record_operation"):
            if not hasattr(tape, name):
                setattr(tape, name, getattr(record, name))
    import tf_keras
    from bert4keras.models import build_transformer_model

    from keras_recompute import recompute_model
    from keras_recompute.integrations import bert4keras as recompute_bert4keras

    os.environ["RECOMPUTE"] = "0" if method == "none" else "1"  # keras_recompute's switch, read at each call

    if method == "enable":
        recompute_bert4keras.enable()  # the one line: bert4keras's layers, one by one

    tf_keras.utils.set_random_seed(0)
    bert = build_transformer_model(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=1024,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=256,
    )
    cls = tf_keras.layers.Lambda(lambda x: x[:, 0])(bert.output)
    model = tf_keras.Model(bert.inputs, tf_keras.layers.Dense(2, activation="softmax")(cls))
    if method == "model":
        recompute_model(model)  # the one line: each transformer block as one unit
    model.compile(optimizer=tf_keras.optimizers.Adam(3e-4), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    arguments = _arguments()
    rng = np.random.RandomState(0)
    tokens = rng.randint(10, 1000, size=(arguments.samples, 128))
    labels = rng.randint(0, 2, size=arguments.samples)
    tokens[:, 1] = 7 + labels
    tokens[:, 0] = 2  # [CLS]
    segments = np.zeros_like(tokens)
    model.fit([tokens[:32], segments[:32]], labels[:32], batch_size=32, verbose=0)  # build and trace
    tf.config.experimental.reset_memory_stats("CPU:0")
    history = model.fit([tokens, segments], labels, batch_size=32, epochs=arguments.epochs, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    print(
        f"{method:<6}: loss {history.history['loss'][-1]:.4f}, "
        f"accuracy {history.history['accuracy'][-1]:.3f}, peak {peak:.0f} MB"
    )


def _arguments():
    parser = argparse.ArgumentParser(description="Fine-tune a bert4keras BERT classifier four ways.")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of training (default 3)")
    parser.add_argument("--samples", type=int, default=512, help="sentences to train on, at least 32 (default 512)")
    return parser.parse_args()


if __name__ == "__main__":
    _arguments()  # --help, and errors, before any child starts
    from _off_and_on import main  # examples/_off_and_on.py: one child per variant

    main(__file__, train, [(method, {METHOD: method}) for method in ("none", "theirs", "enable", "model")])
