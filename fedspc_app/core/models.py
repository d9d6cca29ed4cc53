"""Former path of the models and build_model, kept so that code written against it still
runs: every name is looked up in :mod:`fedspc_app.models.networks`, its home now, with a
DeprecationWarning. New code imports from there."""

from fedspc_app.core.moved import forward

__getattr__ = forward(__name__, "fedspc_app.models.networks")
