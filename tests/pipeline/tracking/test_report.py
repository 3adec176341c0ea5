import numpy as np
import pytest
from sklearn.metrics import precision_recall_fscore_support

from pipeline.tracking.run import per_class_report


def test_per_class_report_matches_sklearn():
    rng = np.random.default_rng(0)
    truth, predicted = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    confusion = np.zeros((3, 3), dtype=int)
    np.add.at(confusion, (truth, predicted), 1)
    report = per_class_report(confusion, ["a", "b", "c"])
    precision, recall, f1, support = precision_recall_fscore_support(truth, predicted)
    for i, name in enumerate("abc"):
        assert report[name]["precision"] == pytest.approx(precision[i], abs=1e-6)
        assert report[name]["recall"] == pytest.approx(recall[i], abs=1e-6)
        assert report[name]["f1"] == pytest.approx(f1[i], abs=1e-6)
        assert report[name]["support"] == support[i]
