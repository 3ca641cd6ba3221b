"""A character-level tokenizer and a tiny random Qwen2 model, built in code for rollout tests;
and the real R1-Distill-Qwen tokenizer from the shared fixtures, loaded once per test run."""
import functools
import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

REAL_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "..", "shared", "fixtures", "r1_distill_qwen_7b")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=()[]{}\\$.,:;!?\n")


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (61 ids: 4 specials, then CHARS); decoding concatenates."""
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def model(vocab_size=300, hidden=32, layers=2, seed=0, heads=4) -> Qwen2ForCausalLM:
    """Random tiny Qwen2 in float32, eval mode, `heads` query heads over 2 KV heads. vocab_size >
    len(tokenizer()) on purpose."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, intermediate_size=2 * hidden,
                      max_position_embeddings=512, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    m = Qwen2ForCausalLM(cfg).eval()
    # Default init (std 0.02) gives near-uniform next-token distributions; larger weights make
    # greedy choices clear-cut, so batch/alone comparisons are not decided by float noise.
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return m


@functools.lru_cache(maxsize=None)
def real_tokenizer():
    """DeepSeek-R1-Distill-Qwen-7B's tokenizer (fixture without weights), or None when absent."""
    if not os.path.isdir(REAL_TOKENIZER):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(REAL_TOKENIZER)


def fixed_rollouts():
    """(prompts, responses, advantages): the four sequences of ids (vocabulary 64) and their
    advantages that the FSDP2 scripts (tests/fsdp_*.py) update on, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 2, 7, 3)]
    return prompts, responses, torch.tensor([1.0, -0.5, 0.3, -1.2])
