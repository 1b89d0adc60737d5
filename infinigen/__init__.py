"""infinigen: long-context decoding with the KV cache in CPU memory (InfiniGen, OSDI 2024)."""

__version__ = "0.1.0"
