"""--kv-events-config: vLLM's names and defaults, and clear errors for anything else."""

import argparse

import pytest

from prefixcache.config import EngineConfig
from prefixcache.engine.args import add_engine_args, engine_kwargs
from prefixcache.kv_events.config import KVEventsConfig


def test_defaults_are_vllms():
    config = KVEventsConfig()
    assert config.enable_kv_cache_events is False
    assert config.publisher == "null"
    assert config.endpoint == "tcp://*:5557"
    assert config.replay_endpoint is None
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    assert config.topic == ""
    assert config.block_hash_encoding == "uint64"
    assert (config.endpoint_mode, config.publish_token_ids) == ("auto", True)


def test_enabling_events_picks_the_zmq_publisher_unless_one_is_named():
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").publisher == "null"


@pytest.mark.parametrize(
    ("endpoint", "mode", "bound"),
    [
        ("tcp://*:5557", "auto", True),  # vLLM's rule: a wildcard, ::, ipc:// and inproc:// are bound
        ("tcp://127.0.0.1:*", "auto", True),
        ("tcp://[::1]:5557", "auto", True),
        ("ipc:///run/prefixcache/events", "auto", True),
        ("inproc://events", "auto", True),
        ("tcp://127.0.0.1:5557", "auto", False),  # ... and any other address is connected to
        ("tcp://10.0.0.2:5557", "auto", False),
        ("tcp://127.0.0.1:5557", "bind", True),  # one address bound, without the wildcard
        ("tcp://10.0.0.2:5557", "bind", True),
        ("ipc:///run/prefixcache/events", "connect", False),
    ],
)
def test_the_endpoint_is_bound_by_vllms_rule_unless_the_mode_says(endpoint, mode, bound):
    assert KVEventsConfig(endpoint=endpoint, endpoint_mode=mode).binds_endpoint is bound


def test_from_json_reads_vllms_flag_value():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv-events", "buffer_steps": 5}')
    assert (config.enable_kv_cache_events, config.topic, config.buffer_steps) == (True, "kv-events", 5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"enable_kv_cache_event": true}', "unknown field(s) enable_kv_cache_event"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "localhost:5557"}', "endpoint must be a ZeroMQ address"),
        ('{"endpoint": "tcp://"}', "endpoint must be a ZeroMQ address"),
        ('{"replay_endpoint": "5558"}', "replay_endpoint must be a ZeroMQ address"),
        ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
        ('{"max_queue_size": true}', "max_queue_size must be an integer >= 1"),
        ('{"hwm": -1}', "hwm must be an integer >= 0"),
        ('{"topic": 3}', "topic must be a string"),
        ('{"block_hash_encoding": "hex"}', "block_hash_encoding must be one of uint64, bytes"),
        ('{"endpoint_mode": "listen"}', "endpoint_mode must be one of auto, bind, connect"),
        ('{"endpoint_mode": "connect"}', "has a wildcard, which can be bound, not connected to"),
        ('{"publish_token_ids": 0}', "publish_token_ids must be true or false"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError) as info:
        KVEventsConfig.from_json(text)
    assert message in str(info.value)


def test_engine_config_takes_a_config_a_dict_or_json():
    expected = KVEventsConfig(enable_kv_cache_events=True, topic="t")
    as_json = '{"enable_kv_cache_events": true, "topic": "t"}'
    for value in (expected, {"enable_kv_cache_events": True, "topic": "t"}, as_json):
        assert EngineConfig(kv_events_config=value).kv_events_config == expected
    assert EngineConfig().kv_events_config is None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p)
    return p


def test_the_command_line_flag_reaches_the_engine_config():
    args = parser().parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}'])
    config = EngineConfig(**engine_kwargs(args))
    assert config.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, endpoint="ipc:///tmp/x")
    assert EngineConfig(**engine_kwargs(parser().parse_args([]))).kv_events_config is None


def test_a_bad_flag_value_is_a_usage_error_naming_the_problem():
    with pytest.raises(argparse.ArgumentError, match="unknown field"):
        parser().parse_args(["--kv-events-config", '{"bogus": 1}'])
