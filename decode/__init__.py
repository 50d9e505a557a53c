"""Decoding: target-model wrapper, drafters, lossless verification and the decode loop.

Sees token ids and tensors only: never text, file formats or click.
"""
