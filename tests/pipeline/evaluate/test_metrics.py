"""Metric arithmetic from additive partials."""
import numpy as np



def test_binary_roc_auc_adds_up_across_partitions_like_sklearn():
    from sklearn.metrics import roc_auc_score

    from pipeline.evaluate.metrics import classification_metrics, classification_partials

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 4000)
    logits = np.stack([np.zeros(4000), y + rng.normal(0, 1, 4000)], axis=1)
    total = sum(classification_partials(logits[i:i + 700], y[i:i + 700], 2) for i in range(0, 4000, 700))
    metrics, confusion = classification_metrics(total, 2)
    assert confusion.sum() == 4000
    assert abs(metrics["roc_auc"] - roc_auc_score(y, 1 / (1 + np.exp(-logits[:, 1])))) < 1e-3
    three, _ = classification_metrics(classification_partials(np.eye(3)[y], y, 3), 3)
    assert "roc_auc" not in three
