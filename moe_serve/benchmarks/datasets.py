"""Workloads for `moe-serve bench serve`: what each request asks for.

A workload is a list of jobs. A job is a `Sample` (one request) or a `Conversation` (several
requests sent one after another, each extending the previous one's prompt and answer).

- random: random token ids of exact lengths (sent as a token-id list to /v1/completions), or random
  English words for /v1/chat/completions; lengths drawn uniformly within +-range_ratio of the mean,
  after an optional prefix that every request shares.
- sharegpt: the first human turn of ShareGPT-format conversations as the prompt; the gpt turn
  that follows gives the output length (its token count), unless a fixed length is asked for.
- prefix_repetition: a few random prefixes, each shared by an equal share of the requests, and a
  random suffix per request: a prefix-cache workload.
- multi_turn: conversations whose turn k+1 is turn k's prompt, the answer actually received and a
  new user message, sent only after turn k finished: each later turn shares a growing prefix.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

DATASETS = ("random", "sharegpt", "prefix_repetition", "multi_turn")

# Plain, common English words: "random words" prompts read like text to any tokenizer.
WORDS = ("the of and to in is was for on are with as his they be at one have this from by hot word but "
         "what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two "
         "has look more day could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where after back little "
         "only round man year came show every good me give our under name very through just form sentence "
         "great think say help low line differ turn cause much mean before move right boy old too same tell "
         "does set three want air well also play small end put home read hand port large spell add even land "
         "here must big high such follow act why ask men change went light kind off need house picture try "
         "again animal point mother world near build self earth father head stand own page should country "
         "found answer school grow study still learn plant cover food sun four between state keep eye never "
         "last let thought city tree cross farm hard start might story saw far sea draw left late run while "
         "press close night real life few north open seem together next white children begin got walk example "
         "ease paper group always music those both mark often letter until mile river car feet care second book "
         "carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
         "color face wood main enough plain girl usual young ready above ever red list though feel talk bird "
         "soon body dog family direct pose leave song measure door product black short numeral class wind "
         "question happen complete ship area half rock order fire south problem piece told knew pass since top "
         "whole king space heard best hour better true during hundred five remember step early hold west ground "
         "interest reach fast verb sing listen six table travel less morning ten simple several vowel toward war "
         "lay against pattern slow center love person money serve appear road map rain rule govern pull cold "
         "notice voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star "
         "box noun field rest correct able pound done beauty drive stood contain front teach week final gave "
         "green oh quick develop ocean warm free minute strong special mind behind clear tail produce fact").split()


@dataclass
class Sample:
    """One request: a prompt (text, or token ids for /v1/completions) and the output length to ask for.
    prompt_len is the prompt's token count where the client knows it (token ids, tokenized text)."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None


@dataclass
class Conversation:
    """multi_turn: each turn's new user message and output length, sent in order."""

    turns: list[Sample] = field(default_factory=list)


Job = Sample | Conversation


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn within +-range_ratio of `mean` (at least 1)."""
    lo = max(1, int(mean * (1 - range_ratio)))
    return lo, max(lo, int(mean * (1 + range_ratio)))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def token_ids(rng: random.Random, n: int, pool: range | list[int]) -> list[int]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def random_samples(n: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                   pool: range | list[int], text: bool, seed: int) -> list[Sample]:
    """`n` requests of prefix_len shared tokens (words when `text`) plus a drawn number of random ones."""
    rng = random.Random(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    prefix: str | list[int] = words(rng, prefix_len) if text else token_ids(rng, prefix_len, pool)
    out = []
    for _ in range(n):
        k, m = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        if text:
            out.append(Sample(" ".join(x for x in (prefix, words(rng, k)) if x), m))
        else:
            ids = prefix + token_ids(rng, k, pool)
            out.append(Sample(ids, m, len(ids)))
    return out


def prefix_repetition_samples(n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int,
                              pool: range | list[int], text: bool, seed: int) -> list[Sample]:
    """`n` requests over `num_prefixes` random prefixes (as evenly as n allows), in shuffled order."""
    rng = random.Random(seed)
    make = (lambda k: words(rng, k)) if text else (lambda k: token_ids(rng, k, pool))
    prefixes = [make(prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        prefix, suffix = prefixes[i % num_prefixes], make(suffix_len)
        if text:
            out.append(Sample(f"{prefix} {suffix}", output_len))
        else:
            out.append(Sample(prefix + suffix, output_len, len(prefix) + len(suffix)))
    rng.shuffle(out)
    return out


def multi_turn_conversations(n: int, num_turns: int, input_len: int, output_len: int, range_ratio: float,
                             seed: int) -> list[Conversation]:
    """`n` conversations of `num_turns` turns; each turn's user message is random words."""
    rng = random.Random(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    return [Conversation([Sample(words(rng, rng.randint(in_lo, in_hi)), rng.randint(out_lo, out_hi))
                          for _ in range(num_turns)]) for _ in range(n)]


def sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, the gpt turn after it) of every conversation in a ShareGPT-format JSON
    file: a list of {"conversations": [{"from": "human" | "gpt", "value": "..."}, ...]}."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        for i, t in enumerate(turns[:-1]):
            if not isinstance(t, dict) or t.get("from") not in ("human", "user"):
                continue
            nxt = turns[i + 1]
            if isinstance(nxt, dict) and nxt.get("from") in ("gpt", "assistant") and t.get("value") \
                    and isinstance(nxt.get("value"), str):
                pairs.append((t["value"], nxt["value"]))
            break  # the first human turn only
    return pairs


def sharegpt_samples(path: str, n: int, count_tokens: Callable[[str], int], fixed_output_len: int | None,
                     seed: int, max_model_len: int | None = None) -> list[Sample]:
    """`n` samples drawn (shuffled by `seed`) from the file's prompt/answer pairs. As is usual for
    ShareGPT, pairs whose prompt or answer is under 4 tokens, or that do not fit max_model_len, are
    skipped; when fewer than `n` remain, they are reused in turn."""
    pairs = sharegpt_pairs(path)
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with a human turn followed by a gpt turn")
    random.Random(seed).shuffle(pairs)
    out: list[Sample] = []
    for prompt, answer in pairs:
        if len(out) == n:
            break
        plen = count_tokens(prompt)
        olen = fixed_output_len if fixed_output_len is not None else count_tokens(answer)
        if plen < 4 or olen < (1 if fixed_output_len is not None else 4):
            continue
        if max_model_len is not None and plen + olen > max_model_len:
            continue
        out.append(Sample(prompt, olen, plen))
    if not out:
        raise ValueError(f"--dataset-path {path}: every conversation is too short (under 4 tokens) or too long "
                         f"for max_model_len={max_model_len}")
    base = len(out)
    while len(out) < n:
        out.append(out[len(out) % base])
    return out
