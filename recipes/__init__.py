"""Single-file recipes (torchtune style) and their YAML configs.

Run a recipe with ``preft train recipes/configs/NAME.yaml [key=value ...]``; copy a recipe to
change it. The trainers they call are library code: :mod:`preft.trainers`.
"""
