"""Single-file recipes (torchtune style) and their YAML configs; run with `preft train CONFIG`."""
