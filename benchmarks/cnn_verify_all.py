"""`keras_recompute.verify` on CNNs from libraries we did not write, fine-tuned under a head.

Each model is a keras.applications model (no pretrained weights) or, where keras-cv is installed, a
keras-cv backbone built small from its constructor (the sizes its own tests use, narrowed), nested
in a model as transfer learning nests it (`backbone(inputs)`, a pooling, a `Dense(1)`), compiled
with SGD and MSE. `verify(model, x, zeros, trials=2)` runs the compiled step plain and with
`recompute_model(blocks="auto")`: "auto" cuts the backbone's graph into its blocks (NOTE [ a model
inside a model ], NOTE [ blocks that are pieces of a graph ] in `keras_recompute/_model.py`), and
every weight's first update, BatchNorm's moving statistics with them, is compared (NOTE [ what verify
compares ]). The JSON records per model the verdict, the units recomputed, the largest difference
(normwise) and the seconds taken. Where the compiled steps differ beyond reassociation, both ran again
op by op (`run_eagerly=True`): `op_by_op_exact` says whether they matched there and `compile_spread`
how far compiling alone moved the plain step's update (BatchNorm over a batch of 2 random images is
ill-conditioned); "cannot tell": the compiled difference is beyond what that allows (NOTE [ what
compiling moves ]).

```
KERAS_BACKEND=torch python benchmarks/cnn_verify_all.py --out benchmarks/results/cnn_verify_all_torch.json
```
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _record  # noqa: E402

APPLICATIONS = {  # name: input size (Xception and InceptionV3 take no less than 71 and 75)
    "ResNet50": 64,
    "ResNet50V2": 64,
    "EfficientNetB0": 64,
    "EfficientNetV2B0": 64,
    "MobileNetV2": 64,
    "MobileNetV3Small": 64,
    "ConvNeXtTiny": 64,
    "DenseNet121": 64,
    "VGG16": 64,
    "Xception": 75,
    "InceptionV3": 75,
}


def keras_cv_models():
    """keras-cv backbones, small: `name -> (build, input shape)`; empty without keras-cv."""
    try:
        import keras_cv
    except ImportError:
        return {}
    m = keras_cv.models
    efficient = dict(stackwise_kernel_sizes=[3, 3, 5], stackwise_num_repeats=[1, 2, 2], stackwise_output_filters=[8, 16, 24],
                     stackwise_strides=[1, 2, 2], width_coefficient=1.0, depth_coefficient=1.0, include_rescaling=False)
    return {
        "keras_cv.ResNetBackbone": (lambda s: m.ResNetBackbone(stackwise_filters=[8, 16], stackwise_blocks=[2, 2], stackwise_strides=[1, 2], include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.ResNetV2Backbone": (lambda s: m.ResNetV2Backbone(stackwise_filters=[8, 16], stackwise_blocks=[2, 2], stackwise_strides=[1, 2], include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.CSPDarkNetBackbone": (lambda s: m.CSPDarkNetBackbone(stackwise_channels=[8, 16, 32, 64], stackwise_depth=[1, 1, 1, 1], include_rescaling=False, input_shape=s), (64, 64, 3)),
        "keras_cv.EfficientNetV1Backbone": (lambda s: m.EfficientNetV1Backbone(stackwise_input_filters=[8, 8, 16], stackwise_expansion_ratios=[1, 6, 6], stackwise_squeeze_and_excite_ratios=[0.25] * 3, input_shape=s, **efficient), (32, 32, 3)),
        "keras_cv.EfficientNetV2Backbone": (lambda s: m.EfficientNetV2Backbone(stackwise_kernel_sizes=[3, 3, 3], stackwise_num_repeats=[1, 2, 2], stackwise_input_filters=[8, 8, 16], stackwise_output_filters=[8, 16, 24], stackwise_expansion_ratios=[1, 4, 4], stackwise_squeeze_and_excite_ratios=[0.0, 0.0, 0.25], stackwise_strides=[1, 2, 2], stackwise_conv_types=["fused", "fused", "unfused"], width_coefficient=1.0, depth_coefficient=1.0, include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.EfficientNetLiteBackbone": (lambda s: m.EfficientNetLiteBackbone(stackwise_input_filters=[32, 8, 16], stackwise_expansion_ratios=[1, 6, 6], input_shape=s, **efficient), (32, 32, 3)),
        "keras_cv.MobileNetV3Backbone": (lambda s: m.MobileNetV3Backbone(stackwise_expansion=[1, 72.0 / 16, 88.0 / 24, 4], stackwise_filters=[16, 24, 24, 40], stackwise_kernel_size=[3, 3, 3, 5], stackwise_stride=[2, 2, 1, 2], stackwise_se_ratio=[0.25, None, None, 0.25], stackwise_activation=["relu", "relu", "relu", "hard_swish"], include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.DenseNetBackbone": (lambda s: m.DenseNetBackbone(stackwise_num_repeats=[2, 2], growth_rate=8, include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.MiTBackbone": (lambda s: m.MiTBackbone(depths=[2, 2, 1, 1], include_rescaling=False, input_shape=s, embedding_dims=[8, 16, 40, 64]), (64, 64, 3)),
        "keras_cv.ViTDetBackbone": (lambda s: m.ViTDetBackbone(include_rescaling=False, input_shape=s, patch_size=8, embed_dim=16, depth=2, mlp_dim=32, num_heads=2, global_attention_layer_indices=[1], window_size=2), (32, 32, 3)),
        "keras_cv.YOLOV8Backbone": (lambda s: m.YOLOV8Backbone(stackwise_channels=[8, 16, 32, 64], stackwise_depth=[1, 1, 1, 1], include_rescaling=False, input_shape=s), (32, 32, 3)),
        "keras_cv.VideoSwinBackbone": (lambda s: m.VideoSwinBackbone(input_shape=s, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[2, 4, 4], patch_size=[2, 4, 4], include_rescaling=False), (4, 32, 32, 3)),
        "keras_cv.VGG16Backbone": (lambda s: m.VGG16Backbone(input_shape=s, include_rescaling=False, include_top=False), (32, 32, 3)),
    }


def models(keras):
    found = {
        f"keras.applications.{name}": (
            lambda s, name=name: getattr(keras.applications, name)(include_top=False, weights=None, input_shape=s),
            (size, size, 3),
        )
        for name, size in APPLICATIONS.items()
    }
    found.update(keras_cv_models())
    return found


def fine_tuned(keras, backbone, shape):
    """`backbone` nested under a head, as transfer learning builds it."""
    inputs = keras.Input(shape)
    features = backbone(inputs)
    if isinstance(features, dict):
        features = list(features.values())[-1]
    pooled = keras.ops.mean(features, axis=list(range(1, len(features.shape) - 1)))
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", help="names (as in the JSON), or parts of them; default: all")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    import keras
    import numpy as np

    from keras_recompute import verify

    results = {}
    for name, (build, shape) in models(keras).items():
        if args.models and not any(part in name for part in args.models):
            continue
        start = time.time()
        try:
            keras.utils.set_random_seed(0)
            model = fine_tuned(keras, build(shape), shape)
            x = np.random.RandomState(0).rand(2, *shape).astype("float32")
            report = verify(model, x, np.zeros((2, 1), "float32"), trials=2, memory=False)
            row = {"verdict": "ok" if report.ok else "cannot tell" if report.cannot_tell else "FAILED", "units": len(report.units)}
            if report.op_by_op is not None and report.op_by_op.get("error") is None:
                # NOTE [ what compiling moves ]: where the compiled steps differ, both ran again op by op
                row["op_by_op_exact"] = bool(report.op_by_op["exact"])
                row["compile_spread"] = report.op_by_op["compile_spread"]  # what compiling moves the plain step
            row["difference"] = max((r["difference"] for r in report.rows), default=None)  # normwise
            if not report.ok:
                row["report"] = str(report)
        except Exception as error:  # a model that does not build or train here: recorded with its error
            row = {"verdict": "error", "error": f"{type(error).__name__}: {str(error)[:300]}"}
            traceback.print_exc()
        row["seconds"] = round(time.time() - start, 1)
        results[name] = row
        print(f"{name:40s} {row['verdict']:7s} {row.get('units', '')} {row['seconds']} s", flush=True)
    summary = {verdict: sum(r["verdict"] == verdict for r in results.values()) for verdict in ("ok", "cannot tell", "FAILED", "error")}
    print(json.dumps(summary))
    if args.out:
        record = dict(_record.metadata(), backend=keras.backend.backend(), keras=keras.__version__, summary=summary, results=results)
        with open(args.out, "w") as file:
            file.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
