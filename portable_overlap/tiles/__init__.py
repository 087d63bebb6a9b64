"""Triton building blocks shared by several ops (one module each, imported, never copied)."""
