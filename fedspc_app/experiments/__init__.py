"""Experiment grids and what they produce (``python -m fedspc_app.experiments``).

``grid`` (grid files → cells), ``runner`` (running cells), ``records`` and
``reports`` (tables), ``plots`` (figures), ``centralized`` (the pooled-data
reference), ``layout`` (a grid folder's files), ``cli`` (the command line).
"""
