"""The ground floor: plain data types that the executor, the model and the checks stand on.

Configs (`config`, the built-in shapes in `configs`), traces (`trace`), snapshots (`snapshot`),
what the executor sees of a side (`sides`: observations, the `Side` protocol) and the usage
errors (`errors`). Nothing here imports another part of kvfuzz.
"""
