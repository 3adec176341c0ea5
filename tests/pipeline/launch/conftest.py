"""Fixtures shared by the launch tests."""
import pytest


@pytest.fixture(scope="module")
def user_models(spark):
    """tests/pipeline/models/user_models.py importable as `user_models` here and in the Python workers."""
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "user_models.py")
    sys.path.insert(0, os.path.dirname(path))
    spark.sparkContext.addPyFile(path)
    yield "user_models"
    sys.path.remove(os.path.dirname(path))
