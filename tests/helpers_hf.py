"""Tiny Hugging Face causal LMs and tokenizers built from configs, saved as local checkpoints
(nothing is downloaded)."""
import torch

VOCAB = 90  # real token ids
LM_HEAD_ROWS = 96  # lm_head rows, padded like real models'
FAMILIES = ("llama", "qwen2")


def tiny_config(family: str, *, tie: bool = False, attention: str = "sdpa", layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return config_class(vocab_size=LM_HEAD_ROWS, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=tie, attn_implementation=attention, bos_token_id=2, eos_token_id=1,
                        pad_token_id=0)


def tiny_causal_lm(family: str = "llama", *, seed: int = 0, tie: bool = False, attention: str = "sdpa",
                   layers: int = 2):
    """A randomly initialized tiny model (float32) of ``family``: "llama" or "qwen2" (Qwen2 has
    q/k/v biases)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, tie=tie, attention=attention, layers=layers))


def tiny_tokenizer(vocab: int = VOCAB, *, swap: tuple = (), eos: str = "<eos>"):
    """A word-level tokenizer of ``vocab`` ids: <pad> 0, <eos> 1, <bos> 2, then w3, w4, ...;
    ``swap`` exchanges the ids of two words, ``eos`` names the eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(3, vocab)]
    ids = {word: index for index, word in enumerate(words)}
    if swap:
        first, second = swap
        ids[first], ids[second] = ids[second], ids[first]
    tokenizer = Tokenizer(models.WordLevel(vocab=ids, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token=eos, bos_token="<bos>",
                                   unk_token="<pad>")


def save_checkpoint(directory, family: str = "llama", *, seed: int = 0, tie: bool = False, tokenizer=None) -> str:
    """A tiny model and its tokenizer saved with save_pretrained: a "local HF checkpoint"."""
    model = tiny_causal_lm(family, seed=seed, tie=tie)
    model.save_pretrained(directory)
    (tokenizer or tiny_tokenizer()).save_pretrained(directory)
    return str(directory)
