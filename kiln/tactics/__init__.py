"""Lowering: kernel implementations per layer (tactics), the registry of candidates, reformats between layouts,
the autotuner that times candidates and its timing cache. `kiln.tactics.registry` lists the candidates."""
