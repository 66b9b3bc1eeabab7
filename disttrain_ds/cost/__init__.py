"""Cost and memory formulas, each written once."""
