"""Label indexing as a vectorized pandas UDF: original label value -> dense class index."""

from typing import Mapping


def make_label_indexer(mapping: Mapping[str, int]):
    """A pandas UDF mapping the string form of each label to its index; unknown labels become null."""
    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    lookup = dict(mapping)

    @pandas_udf("bigint")
    def index_label(values: pd.Series) -> pd.Series:
        return values.map(lookup).astype("Int64")

    return index_label
