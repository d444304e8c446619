"""The tiny tokenizer.json of the tests, shaped like Llama 3's: byte-level BPE, the special tokens
<|begin_of_text|> and <|end_of_text|>, and a post-processor template that puts BOS first.

    python tests/tokenizer_fixture.py      # writes tests/fixtures/tokenizer/tokenizer.json

`tests/test_finetune.py` checks that the committed file is what this makes.
"""
import os

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tokenizer", "tokenizer.json")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
TEXTS = ["the cat sat on the mat", "the dog ate the cat", "def f(x):\n    return x  # a comment",
         "Hello, world. Bonjour, le monde."]
VOCAB_SIZE = 300          # <= the Hugging Face fixtures' vocabularies (320, 330)


def make_tokenizer(specials=LLAMA3_SPECIALS, bos=LLAMA3_SPECIALS[0]):
    """A `tokenizers.Tokenizer`: the 256 byte symbols, `specials` (ids 0, 1, ...), merges up to
    VOCAB_SIZE; with `bos`, a template that puts it before every sequence (as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


if __name__ == "__main__":
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    make_tokenizer().save(FIXTURE, pretty=True)
    print(f"wrote {FIXTURE}")
