"""Built-in models, user factories, the flat-parameter view the parameter server works on, and the flat
state (parameters + buffers) the merged model travels as."""
from pipeline.models.build import ModelSpec, build_model, loss_fn, model_from_flat, model_spec
from pipeline.models.flat import flat_gradients, flat_parameters, load_flat_parameters, num_parameters
from pipeline.models.state import (buffer_layout, flat_buffers, flat_state, load_flat_buffers, load_flat_state,
                                   state_size)

__all__ = ["ModelSpec", "build_model", "loss_fn", "model_from_flat", "model_spec",
           "flat_gradients", "flat_parameters", "load_flat_parameters", "num_parameters",
           "buffer_layout", "flat_buffers", "flat_state", "load_flat_buffers", "load_flat_state", "state_size"]
