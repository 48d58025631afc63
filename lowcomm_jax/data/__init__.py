"""Corpora (text or pre-tokenized files), tokenizers and per-worker grain pipelines."""

from lowcomm_jax.data.corpus import DataError, resolve_corpus
from lowcomm_jax.data.pipeline import (WorkerStreams, eval_windows, probe_windows,
                                       split_train_val)
from lowcomm_jax.data.source import Corpus, open_corpus, other_corpus
from lowcomm_jax.data.tokenizers import (TOKENIZER_NAMES, TOKENIZER_VOCAB, get_tokenizer,
                                         is_tokenizer_file, load_tokens)
