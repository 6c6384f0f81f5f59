"""The MuTIS turn rule on a scripted engine: every branch of `rollout.sample` taken on purpose.

The engine returns scripted token ids per prompt and turn (tokenized with the real SmolLM2 tokenizer),
so each case below -- answer in a budget cut, answerless EOS, two answers, no answer at all -- happens
exactly as written instead of whenever a random model happens to produce it."""
import pytest

import reward
import rollout
from infra import engines
from infra.hf import load_tokenizer

EOS = 2  # <|im_end|>
ALT_EOS = 0  # <|endoftext|>: a second end-of-turn id, as in Qwen2.5 / Llama 3 generation configs


class ScriptedEngine:
    """generate() answers prompt p's k-th call with script[p][k] (token ids), cut to max_tokens.
    A script ending in an end-of-turn id (or holding a stop string) is `stopped`, else cut by the budget."""

    def __init__(self, tokenizer, scripts, max_model_len=4096):
        self.tokenizer, self.scripts, self.max_model_len = tokenizer, scripts, max_model_len
        self.prompts = {}  # first prompt token tuple -> script index
        self.calls = {}
        self.requests = []

    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(),
                 eos_ids=None, timeout=None, poll=None):
        out = []
        budgets = engines._per_prompt(max_tokens, len(prompt_token_ids))
        self.requests.append((list(stop), list(eos_ids)))
        for ids, budget in zip(prompt_token_ids, budgets):
            p = next(i for key, i in self.prompts.items() if tuple(ids[:len(key)]) == key)
            turn = self.calls.get(p, 0)
            self.calls[p] = turn + 1
            script = list(self.scripts[p][turn])
            stopped = False
            for k, tok in enumerate(script):  # end at the first end-of-turn id or completed stop string
                if tok in eos_ids or any(s in self.tokenizer.decode(script[:k + 1]) for s in stop):
                    script, stopped = script[:k + 1], True
                    break
            if len(script) > budget:
                script, stopped = script[:budget], False
            out.append(engines.Completion(script, [-0.5] * len(script), stopped))
        return out


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def iv(tok):
    return rollout.intervention_ids(tok, "reference")


def ids(tok, text, end=None):
    return tok.encode(text, add_special_tokens=False) + ([end] if end is not None else [])


def run(tok, iv, turns_by_prompt, *, turn_tokens, max_turns=2, **kw):
    prompts = [ids(tok, f"Problem {i}: what is 2 + 2?") for i in range(len(turns_by_prompt))]
    engine = ScriptedEngine(tok, turns_by_prompt)
    engine.prompts = {tuple(p): i for i, p in enumerate(prompts)}
    ro = rollout.sample(engine, prompts, n=1, turn_tokens=turn_tokens, max_turns=max_turns, temperature=1.0,
                        intervention_ids=iv, eos_ids=[EOS, ALT_EOS], **kw)
    return ro, engine


def kept_actions(t):
    return [x for x, m in zip(t["response_ids"], t["action_mask"]) if m]


def test_budget_cut_turn_with_an_answer_ends_cut_after_the_brace(tok, iv):
    text = "Two plus two: \\boxed{4} and then I keep talking about other things for a while longer"
    script = ids(tok, text)
    (t,), _ = run(tok, iv, [[script]], turn_tokens=len(script) - 2)  # the budget cuts the turn
    want = ids(tok, "Two plus two: \\boxed{4}")
    assert t["response_ids"] == want == script[:len(want)]
    assert t["action_mask"] == [1] * len(want) and len(t["rollout_logprobs"]) == len(want)
    assert (t["turns"], t["interventions"], t["answered"], t["finished"], t["truncated"]) == (1, 0, True, True, False)
    assert t["cut_turns"] == 1


def test_answerless_eos_turn_gets_an_intervention_and_loses_its_eos(tok, iv):
    first, second = ids(tok, "I think it is four.", EOS), ids(tok, "So \\boxed{4}", ALT_EOS)
    (t,), engine = run(tok, iv, [[first, second]], turn_tokens=64)
    assert t["response_ids"] == first[:-1] + iv + second  # the answerless turn's EOS is cut; the answer's stays
    assert t["action_mask"] == [1] * (len(first) - 1) + [0] * len(iv) + [1] * len(second)
    assert EOS not in t["response_ids"]
    assert (t["turns"], t["interventions"], t["answered"], t["finished"]) == (2, 1, True, True)
    assert engine.requests[0] == (["</answer>"], [ALT_EOS, EOS])  # every end-of-turn id, the stop string


def test_two_answers_keep_the_first_and_score_it(tok, iv):
    script = ids(tok, "\\boxed{4} wait \\boxed{5}", EOS)
    (t,), _ = run(tok, iv, [[script]], turn_tokens=64)
    assert t["response_ids"] == ids(tok, "\\boxed{4}")
    assert t["policy_text"] == "\\boxed{4}"
    (s,) = reward.score_batch(["math"], [t["policy_text"]], ["4"], first=True)
    assert (s["pred"], s["acc"]) == ("4", 1.0)
    # --no-cut-at-answer: every token stays (EOS too) and the last answer is scored
    (u,), _ = run(tok, iv, [[script]], turn_tokens=64, cut_at_answer=False)
    assert u["response_ids"] == script and u["cut_turns"] == 0
    (s,) = reward.score_batch(["math"], [u["policy_text"]], ["4"], first=False)
    assert (s["pred"], s["acc"]) == ("5", 0.0)


def test_max_turns_answerless_turns_end_truncated(tok, iv):
    ramble = ids(tok, "Let me think about this problem step by step and carefully consider it")
    (t,), engine = run(tok, iv, [[ramble] * 3], turn_tokens=10, max_turns=2)
    assert (t["turns"], t["interventions"], t["answered"], t["finished"], t["truncated"]) == (3, 2, False, False, True)
    assert t["hit_cap"]  # the last turn's budget cut it
    assert t["response_ids"] == ramble[:10] + iv + ramble[:10] + iv + ramble[:10]
    assert kept_actions(t) == ramble[:10] * 3 and engine.calls == {0: 3}
    # the last turn ends on EOS without an answer: out of turns, it keeps its EOS and is truncated
    (t,), _ = run(tok, iv, [[ramble[:10], ramble[:10], ids(tok, "no idea", EOS)]], turn_tokens=10, max_turns=2)
    assert t["response_ids"][-1] == EOS and t["truncated"] and not t["answered"]
    assert not t["hit_cap"]  # the model ended it, no token limit did (eval.py's 'truncated')


def test_paper_rule_intervenes_on_budget_cuts_only(tok, iv):
    ramble, stop = ids(tok, "Let me think about this problem step by step"), ids(tok, "It is four.", EOS)
    (t,), _ = run(tok, iv, [[ramble, stop]], turn_tokens=6, turn_rule="paper")
    assert t["response_ids"] == ramble[:6] + iv + stop  # EOS without an answer ends it, EOS kept
    assert (t["turns"], t["finished"], t["truncated"], t["answered"]) == (2, True, False, False)
    with pytest.raises(ValueError):
        rollout.wants_intervention(False, True, "budget")


def test_the_rule_itself():
    w = rollout.wants_intervention
    for rule in rollout.TURN_RULES:
        assert not w(True, True, rule) and not w(True, False, rule)  # an answer always ends it
        assert w(False, True, rule)  # an answerless budget cut always gets one
    assert w(False, False, "reference") and not w(False, False, "paper")  # answerless EOS


@pytest.mark.parametrize("text,kept,answer", [
    ("So <answer>4</answer> and more <answer>5</answer>", "So <answer>4</answer>", "4"),
    ("Work.\nFinal Answer: 4\n\nBut wait, maybe 5.", "Work.\nFinal Answer: 4", "4"),
    ("Answer: 4 is what I get\n\nor not", "Answer: 4 is what I get", "4 is what I get"),
    ("First \\boxed{\\frac{1}{2}} then \\boxed{3}", "First \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
])
def test_cut_keeps_the_shortest_prefix_with_the_first_answer(tok, iv, text, kept, answer):
    script = ids(tok, text, EOS)
    (t,), _ = run(tok, iv, [[script]], turn_tokens=64)
    n = len(t["response_ids"])
    assert t["response_ids"] == script[:n] and tok.decode(t["response_ids"]) == kept
    assert reward.find_answer(tok.decode(script[:n - 1]), first=True) != reward.find_answer(kept, first=True)
    assert reward.extract_answer(t["policy_text"], first=True) == answer


@pytest.mark.parametrize("end", [EOS, ALT_EOS])
def test_an_end_of_turn_right_after_the_answer_is_kept(tok, iv, end):
    """The cut drops what follows the first answer, but not the model's own stop right after it: a policy that
    never saw that stop in training would, uncut, run on to the budget."""
    script = ids(tok, "6 + 9 = 15.\nAnswer: 15.", end)
    (t,), _ = run(tok, iv, [[script]], turn_tokens=64)
    assert t["response_ids"] == script and t["action_mask"] == [1] * len(script) and t["cut_turns"] == 0
    assert (t["answered"], t["finished"], t["hit_cap"]) == (True, True, False)
    (r,) = reward.score_batch(["arith"], [t["policy_text"]], ["15"], first=True, last_number=False)
    assert r["acc"] == 1.0
    # a repeated answer line before the stop: the paragraph with the first answer is kept whole, the stop too
    looping = ids(tok, "Answer: 15.\nAnswer: 15.", end)
    (u,), _ = run(tok, iv, [[looping]], turn_tokens=64)
    assert u["response_ids"] == looping
    # text after the answer's paragraph: cut there, and the later stop goes with it
    more = ids(tok, "Answer: 15.\n\nLet me check: 6 + 9 = 15.", end)
    (v,), _ = run(tok, iv, [[more]], turn_tokens=64)
    assert v["response_ids"] == ids(tok, "Answer: 15.") and v["cut_turns"] == 1


def test_an_intervention_is_never_read_as_the_answer(tok):
    iv = rollout.intervention_ids(tok, "Invalid. Put it as \\boxed{7} or Answer: 7")
    ramble = ids(tok, "Let me think about it and count on my fingers slowly")
    (t,), _ = run(tok, iv, [[ramble] * 3], turn_tokens=8, max_turns=2)
    assert t["interventions"] == 2 and "\\boxed{7}" in t["response_text"] and "7" not in t["policy_text"]
    (s,) = reward.score_batch(["math"], [t["policy_text"]], ["7"], first=True)
    assert s["pred"] is None and s["acc"] == 0.0


def test_last_number_scores_but_never_ends_a_turn(tok, iv):
    digits, other = ids(tok, "I add 2 and 2 to get 4 and"), ids(tok, "or maybe 5 is it, and")
    (t,), _ = run(tok, iv, [[digits, other]], turn_tokens=len(digits), max_turns=1)
    assert t["interventions"] == 1 and not t["answered"]  # the number did not end the first turn
    (s,) = reward.score_batch(["arith"], [t["policy_text"]], ["4"], first=True)
    assert (s["pred"], s["acc"]) == ("5", 0.0)  # the last number of the policy's text
    (s,) = reward.score_batch(["arith"], ["I add 2 and 2 to get 4"], ["4"], first=True)
    assert (s["pred"], s["acc"]) == ("4", 1.0)
