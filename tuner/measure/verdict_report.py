"""The verdict in words: the last line ``tune`` prints (tuner/measure/verdict.py decides what it says)."""

from __future__ import annotations

from typing import Any

from tuner.measure.verdict import Contender, VerdictResult


def verdict_line(result: VerdictResult, slo_text: str) -> str:
    """The last line of ``tune``: the tuned config's shown capacity, paired attainment against the default at its
    rate, each bracket, and the ratio where shown bounds give one."""
    note = (f"claims at {result.level:.0%} together, each candidate's pool at "
            f"{result.look(result.candidates[0]) if result.candidates else result.level:.2%}, the default's at "
            f"{result.look(result.default):.2%}; "
            f"{max(c.rounds for c in [result.default] + result.candidates)} round(s) of fresh draws")
    d = result.default.shown()
    d_text = f"default {d.format()}"
    w = result.winner
    c = w if w is not None else result.best
    if c is None:
        return f"no candidate reached the verdict within {slo_text}: {d_text} ({result.stopped}; {note})"
    mine = c.shown()
    rate = result.headline_rate(c)
    diff = result.paired_difference(c, rate)
    theirs = result.default.pool(rate)
    paired = ""
    if diff is not None and theirs is not None and theirs.requests:
        own = c.pool(rate)
        paired = (f"; at {rate:.3g} req/s on the same arrivals it attains "
                  f"{own.attainment().value:.1%} against the default's {theirs.attainment().value:.1%} "
                  f"({diff.format(' points', 100, 3)})" if own is not None else "")
    ratio = result.ratio(c)
    if w is not None:
        return (f"tuned serves {mine.low:.3g} req/s within {slo_text} ({mine.format()}), {ratio.format()} the "
                f"default's capacity{paired}; {d_text} ({note})")
    served = f"serves {mine.low:.3g} req/s" if mine.low > 0 else "was not shown to serve a rate"
    safest = result.safest
    why = (" (nothing shown served; it attains more than the default on the same arrivals: a choice, not a "
           "capacity claim)" if not safest.is_default and safest.shown().low <= 0 else "")
    return (f"no config was shown to serve more than the default within {slo_text}: best candidate {served} "
            f"({mine.format()}, {result.outcome(c)}){paired}; {d_text}; safest: {safest.name}{why} "
            f"({result.stopped}; {note})")


def capacity_section(result: VerdictResult, chosen: Contender) -> dict[str, Any]:
    """tuned.yaml's ``tuned`` and ``default``: each config's shown bracket (req/s) with its level, its pools, and the
    ratio from shown bounds."""
    def entry(c: Contender) -> dict[str, Any]:
        shown = c.shown()
        return {"name": c.name, "knobs": c.knobs, "searched_req_per_s": c.claim, "capacity_req_per_s": shown.as_dict(),
                "output_tokens_per_s": c.tokens_at(shown.low) if shown.low > 0 else None, "rounds": c.rounds,
                "pools": [{"rate": p.rate, "attaining": p.attaining, "requests": p.requests, "blocks": len(p.blocks()),
                           "attainment": p.attainment().as_dict(), "verdict": p.verdict(), "climb": p.served_only}
                          for p in sorted(c.pools.values(), key=lambda p: p.rate)]}

    tuned = entry(chosen)
    if chosen is not result.default:
        tuned["ratio_to_default"] = result.ratio(chosen).as_dict()
    return {"tuned": tuned, "default": entry(result.default)}

