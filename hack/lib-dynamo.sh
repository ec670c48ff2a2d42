# shellcheck shell=bash
# Dynamo $DYNAMO_VERSION (frontend + mocker, CPU only) in its own virtualenv,
# and a tokenizer-only model directory generated locally (no hub access).
#   DYNSNAP_DYNAMO_PYTHON  $CACHE/dynamo-$DYNAMO_VERSION/bin/python
#                          (`-m dynamo.frontend`, `-m dynamo.mocker`)
#   DYNSNAP_MODEL_DIR      $CACHE/model-tiny-$DYNSNAP_MODEL_REV: config.json,
#                          tokenizer.json, tokenizer_config.json (chat template),
#                          generation_config.json (start the mocker with
#                          --model-name tiny; the default name is the path)
# Separate from the dev venv: Dynamo pins kubernetes (sync) 32.x, transformers,
# pydantic etc. that must not constrain dynsnap's own dependencies.
# Sourced by hack/setup.sh; setup_dynamo is idempotent.

# Bump when the generated model directory changes, so caches are rebuilt.
DYNSNAP_MODEL_REV=2

export DYNSNAP_DYNAMO_VENV="$CACHE/dynamo-$DYNAMO_VERSION"
export DYNSNAP_DYNAMO_PYTHON="$DYNSNAP_DYNAMO_VENV/bin/python"
export DYNSNAP_MODEL_DIR="$CACHE/model-tiny-$DYNSNAP_MODEL_REV"

setup_dynamo() {
  _dynamo_venv
  _dynamo_model_dir
}

_dynamo_venv() {
  local req="$ROOT/hack/dynamo-requirements.txt" venv="$DYNSNAP_DYNAMO_VENV"
  grep -qx "ai-dynamo-runtime==$DYNAMO_VERSION" "$req" \
    || die "hack/dynamo-requirements.txt does not pin ai-dynamo-runtime==$DYNAMO_VERSION (refresh it, see its header)"
  # The marker holds the requirements' hash: editing the pins rebuilds the venv.
  local key; key=$(sha256sum "$req" | cut -c1-16)
  if [[ "$(cat "$venv/.complete" 2>/dev/null)" == "$key" ]]; then
    log "dynamo $DYNAMO_VERSION: cached"; return 0
  fi
  local t0=$SECONDS py="${DYNSNAP_PYTHON:-python3}"
  log "dynamo $DYNAMO_VERSION: creating $venv"
  rm -rf "$venv"
  if ! "$py" -m venv "$venv" 2>/dev/null; then
    # Debian's python3 ships venv/ensurepip separately.
    [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null || die "cannot create $venv (install python3-venv)"
    log "dynamo: apt-get install python3-venv"
    rm -rf "$venv"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; } >&2 \
      || die "apt-get install python3-venv failed"
    "$py" -m venv "$venv" || die "cannot create $venv"
  fi
  # Pinned pip: the requirements were resolved with it.
  "$venv/bin/pip" install -q pip==26.3 >&2 || die "pip upgrade in $venv failed"
  "$venv/bin/pip" install -q -r "$req" >&2 || die "pip install -r $req failed"
  # --no-deps: ai-dynamo requires aisimulate, which cannot be fetched here; the
  # rest of its requirements are in $req.
  "$venv/bin/pip" install -q --no-deps "ai-dynamo==$DYNAMO_VERSION" >&2 \
    || die "pip install ai-dynamo==$DYNAMO_VERSION failed"
  "$venv/bin/python" -c 'import dynamo.frontend, dynamo.mocker, dynamo._core' \
    || die "dynamo $DYNAMO_VERSION: frontend/mocker do not import"
  echo "$key" > "$venv/.complete"
  log "dynamo $DYNAMO_VERSION: installed in $((SECONDS - t0)) s"
}

# A tiny model directory for the mocker and the frontend: they only need a
# tokenizer and a config. The tokenizer is a byte-level BPE trained on a few
# sentences (any text encodes), padded with pseudo-words so that the token ids
# the mocker emits decode to text; built deterministically.
_dynamo_model_dir() {
  local dir="$DYNSNAP_MODEL_DIR"
  if [[ -f "$dir/.complete" ]]; then log "model dir: cached ($dir)"; return 0; fi
  log "model dir: generating $dir"
  rm -rf "$dir.tmp"; mkdir -p "$dir.tmp"
  "$DYNSNAP_DYNAMO_PYTHON" - "$dir.tmp" <<'PY' || die "model dir generation failed"
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = Path(sys.argv[1])
special = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
corpus = [
    "Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "dynsnap suspends idle Dynamo workers and wakes them in place.",
    "A worker answers a pinned request with its own instance id.",
    "Kubernetes pods, EndpointSlices and readiness gates decide who is served.",
    "CRIU dumps a process tree and restores it with the same pids.",
    "What is the capital of France? Paris is the capital of France.",
    "one two three four five six seven eight nine ten",
]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(
    vocab_size=512, min_frequency=1, special_tokens=special,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
)
tok.train_from_iterator(corpus, trainer=trainer)
# The mocker emits token ids around 1000-2000 (observed on 1.6.1), which a
# 512-token BPE cannot decode (empty content). Fill the vocabulary up to 4096
# with readable pseudo-words so its answers decode to text.
syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
words = (f" {a}{b}" for a in syllables for b in syllables)
tok.add_tokens([AddedToken(w, normalized=False) for w, _ in zip(words, range(4096 - tok.get_vocab_size()))])
tok.save(str(out / "tokenizer.json"))
vocab = tok.get_vocab_size()
ids = {t: tok.token_to_id(t) for t in special}

chat_template = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{% elif m['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}{{ m['content'] }}<|eos|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>", "unk_token": None,
    "model_max_length": 4096, "add_bos_token": False, "add_eos_token": False,
    "clean_up_tokenization_spaces": False, "chat_template": chat_template,
}, indent=2) + "\n")
(out / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"], "pad_token_id": ids["<|pad|>"],
    "torch_dtype": "bfloat16", "tie_word_embeddings": True,
}, indent=2) + "\n")
(out / "generation_config.json").write_text(json.dumps({
    "bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"], "pad_token_id": ids["<|pad|>"],
}, indent=2) + "\n")
PY
  touch "$dir.tmp/.complete"
  rm -rf "$dir"; mv "$dir.tmp" "$dir"
  log "model dir: generated $dir"
}
