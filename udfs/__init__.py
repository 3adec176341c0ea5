"""Vectorized (Arrow) UDF bodies run on Spark executors. Imports nothing from `pipeline`, so executors
need only pyarrow/numpy to run them."""
