# Stands in for an absent tf_keras (tests/conftest.py, KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW=1): importing it fails as
# it does where tf_keras is not installed, in the test process and in every child it starts.
raise ModuleNotFoundError("No module named 'tf_keras' (hidden by KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW=1)", name="tf_keras")
