"""The producer's batches on a real broker fit the limits of both answer topics."""

import argparse

import pytest

from worker.core.config import (
    add_settings_arguments,
    settings_from,
)
from worker.core.kafka import (
    make_producer,
    read_record_limits,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.broker
async def test_the_producer_batches_fit_both_answer_topics_limits(
    kafka_bootstrap_servers, new_topic
):
    results = await new_topic(1, configs={"max.message.bytes": str(8 * 2**20)})
    dead_letters = await new_topic(1, configs={"max.message.bytes": str(3 * 2**20)})
    settings = settings_from(
        parse(
            "--bootstrap-servers",
            kafka_bootstrap_servers,
            "--results-topic",
            results,
            "--dead-letter-topic",
            dead_letters,
        ),
        {},
    )

    producer = make_producer(settings, await read_record_limits(settings))

    try:
        assert producer._message_accumulator._batch_size == 3 * 2**20 - 65_536
    finally:
        await producer.stop()
