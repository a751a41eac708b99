"""Convert a tiny GPT-2 to ALiBi and run it at 4x its n_positions, against the unpatched model."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_alibi


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=256, bos_token_id=0, eos_token_id=0
    )
    original = GPT2LMHeadModel(config).eval()
    model = hf_alibi.patch_model(GPT2LMHeadModel(config).eval())
    ids = torch.randint(0, 256, (1, 4 * config.n_positions))
    with torch.no_grad():
        try:
            original(ids)
            print("unpatched GPT-2 at 512 tokens: ran")
        except Exception as error:  # learned positions end at n_positions
            print(f"unpatched GPT-2 at 512 tokens: {type(error).__name__}: {str(error).splitlines()[0][:90]}")
        logits = model(ids).logits
        print(f"ALiBi GPT-2 at 512 tokens: logits {tuple(logits.shape)}, finite={torch.isfinite(logits).all().item()}")
        generated = model.generate(ids[:, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)
    print(f"generated with KV cache: {generated[0, 8:].tolist()}")
    print(f"config.alibi = {model.config.alibi}")


if __name__ == "__main__":
    main()
