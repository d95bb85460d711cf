"""The rounding regions' math: each a plain differentiable function parameterised by a profile (one module each).

Which regions exist, what each wraps and how it is bound: the region registry,
:mod:`rlalign_verl.request.regions`.
"""
