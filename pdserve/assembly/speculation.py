"""Speculative decoding put together: the proposer the config's method names, inside the
speculator the engine calls (pdserve.engine.speculation)."""
from __future__ import annotations

from pdserve.engine.speculation import SpeculationHost
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.spec_decode.draft_model import DraftModelProposer
from pdserve.spec_decode.eagle import eagle_proposer
from pdserve.spec_decode.mtp import mtp_proposer
from pdserve.spec_decode.ngram import NgramProposer
from pdserve.spec_decode.speculator import Speculator
from pdserve.spec_decode.suffix import SuffixProposer


def make_speculator(config: SpeculativeConfig, host: SpeculationHost) -> Speculator:
    return Speculator(config, host, make_proposer(config, host))


def make_proposer(config: SpeculativeConfig, host: SpeculationHost):
    """The method's proposer: propose_batch([(request, k)]) -> drafts (and release(request id))."""
    if config.method == "ngram":
        return NgramProposer(*config.lookup_range)
    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
    if config.method == "draft_model":
        return DraftModelProposer(config, host)
    if config.method == "eagle":
        return eagle_proposer(config, host)
    return mtp_proposer(config, host)
