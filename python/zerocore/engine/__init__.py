"""The engine: zerocore.wrap and the Engine it returns, a facade over its
parts (engine.py says which part does what)."""
from zerocore.engine.engine import Engine, wrap

__all__ = ["Engine", "wrap"]
