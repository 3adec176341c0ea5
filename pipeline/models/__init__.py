"""Built-in models, user factories, and the flat-parameter view the parameter server works on."""
from pipeline.models.build import ModelSpec, build_model, loss_fn, model_from_flat, model_spec
from pipeline.models.flat import flat_gradients, flat_parameters, load_flat_parameters, num_parameters

__all__ = ["ModelSpec", "build_model", "loss_fn", "model_from_flat", "model_spec",
           "flat_gradients", "flat_parameters", "load_flat_parameters", "num_parameters"]
