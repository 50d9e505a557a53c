"""samctl: lossless speculative decoding for outputs that overlap text the model can see."""

__version__ = "0.1.0"
