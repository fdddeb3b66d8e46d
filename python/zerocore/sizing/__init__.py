"""How much memory a model needs: zerocore.estimate, largest_model and the ZeRO formulas."""
