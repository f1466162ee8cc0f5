"""keras_recompute: gradient checkpointing (recompute) for Keras layers."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(HERE, "keras_recompute", "__init__.py"), encoding="utf-8") as init:
    VERSION = re.search(r'^__version__ = "([^"]+)"', init.read(), re.M).group(1)

with open(os.path.join(HERE, "README.md"), encoding="utf-8") as readme:
    LONG_DESCRIPTION = readme.read()

setup(
    name="keras_recompute",
    version=VERSION,
    description="Gradient checkpointing (recompute) for Keras layers: exact gradients, less memory.",
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["keras_recompute", "keras_recompute.*"]),
    python_requires=">=3.7",
    # No framework is required: the user brings TensorFlow (with Keras 3 or
    # tf_keras), JAX or PyTorch. The extras pin what the tests run on.
    install_requires=[],
    extras_require={
        "tensorflow": ["tensorflow-cpu>=2.16", "keras>=3.0"],
        "jax": ["jax", "keras>=3.0"],
        "torch": ["torch", "keras>=3.0"],
        "test": ["pytest>=7"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
