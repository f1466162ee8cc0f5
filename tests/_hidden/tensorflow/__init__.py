# Stands in for an absent tensorflow (tests/conftest.py, KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW=1): importing it fails as
# it does where tensorflow is not installed, in the test process and in every child it starts.
raise ModuleNotFoundError("No module named 'tensorflow' (hidden by KERAS_RECOMPUTE_TESTS_WITHOUT_TENSORFLOW=1)", name="tensorflow")
