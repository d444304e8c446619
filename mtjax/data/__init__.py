"""Data pipeline: tokenize -> indexed token files -> GPT samples -> global batches.

    text/JSONL --preprocess--> PREFIX.bin/.idx --IndexedDataset--> GPTDataset --BatchLoader--> int32 [B, L+1]

  tokenizer       `ByteTokenizer`, `HFTokenizer`, `load_tokenizer`, and the `record` an index keeps;
  build_index     documents (JSONL or text) tokenized into an index (`preprocess`);
  sft             prompt/response samples into an index (`preprocess_sft`), and `NO_LOSS`;
  indexed         the PREFIX.bin/.idx format and `IndexedDataset`, its reader;
  index_format    the .idx header, record and checksums;
  indexed_writer  `IndexedWriter`: both files written all or nothing;
  open_files      `OpenFiles`: token files mapped while read, a bounded number at once;
  sample_index    the pure functions that lay out GPT samples (split, shuffle, windows, epochs);
  gpt_dataset     `GPTDataset`: fixed-length windows of one split, its index cached;
  packed_dataset  `PackedDataset`: fine-tuning samples packed best-fit into rows;
  blending        `BlendedDataset`: several corpora read by weight;
  loader          `BatchLoader`: global batches by data position, and `host_slice`;
  corpus          `default_corpus`: a ready-made dataset from the Python standard library's
                  source, so nothing needs downloading;
  tempfiles       temporary files named by their writer, and the sweep of a dead writer's;
  errors          `DataError`, the one exception of the pipeline.

`mtjax.data.preprocess` is only the entry shim of the preprocessing command
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
