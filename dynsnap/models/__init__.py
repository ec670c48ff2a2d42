"""Pure data: pydantic types and protocol constants. Imports nothing else of dynsnap (bottom layer)."""
