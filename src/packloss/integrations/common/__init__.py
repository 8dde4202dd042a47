"""The floor under the trainer adapters: one config reader, one padded ``[B, T]`` call path, metric
names as data tables and one mapping-row type with its renderer. A trainer adapter is its peer's names
and call signature over these."""
