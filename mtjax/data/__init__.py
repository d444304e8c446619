"""Data pipeline: tokenize -> indexed token files -> GPT samples -> global batches.

    text/JSONL --preprocess--> PREFIX.bin/.idx --IndexedDataset--> GPTDataset --BatchLoader--> int32 [B, L+1]

`default_corpus` builds a ready-made dataset from the Python standard
library's source, so nothing needs downloading. `build_index.preprocess` tokenizes
documents into an index; `mtjax.data.preprocess` is only the entry shim of its command
(`mtjax.commands.preprocess`), not imported here: `python -m` warns when a package
pre-imports the module it runs.
"""

from mtjax.data.corpus import default_corpus
from mtjax.data.errors import DataError
from mtjax.data.gpt_dataset import GPTDataset
from mtjax.data.indexed import IndexedDataset, IndexedWriter, dtype_for_vocab
from mtjax.data.loader import BatchLoader, host_slice
from mtjax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BatchLoader", "ByteTokenizer", "DataError", "GPTDataset", "HFTokenizer", "IndexedDataset",
    "IndexedWriter", "Tokenizer", "default_corpus", "dtype_for_vocab", "host_slice",
    "load_tokenizer",
]
