"""Tools on top of everything: the `rsd` CLI, the process launcher behind `rsd cluster`, model provisioning,
tiny test models, the in-process and service benchmarks and the load test. Nothing below imports this package.
"""
