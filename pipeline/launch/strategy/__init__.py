"""``train.backend: auto``: a measured cost model picks the training strategy and says why.

``candidates`` (what a config leaves open), ``cost_model`` (the prediction, term by term), ``probes`` /
``probe_task`` / ``link_probe`` (the figures, measured at launch), ``choose`` (the pick and its table).
"""
from pipeline.launch.strategy.candidates import Candidate, candidates, has_auto
from pipeline.launch.strategy.choose import Decision, choose_strategy, decide
from pipeline.launch.strategy.cost_model import Constants, Prediction, Probes, predict

__all__ = ["Candidate", "Constants", "Decision", "Prediction", "Probes", "candidates", "choose_strategy", "decide",
           "has_auto", "predict"]
