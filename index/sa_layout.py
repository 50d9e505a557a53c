"""Layout of a suffix-array store's directory (index/suffix_array.py describes it), without numba:
what the table of kinds (index/kinds.py) needs to tell the kind of a store whose manifest is
unreadable."""

FILES = ("tokenized.0", "table.0", "offset.0")  # beside the manifest: tokens, suffix array, document offsets
