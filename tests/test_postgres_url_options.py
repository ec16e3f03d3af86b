"""DATABASE_URL's query options for PostgreSQL (apiary_site.settings._postgres): the
prepare threshold arrives as a number psycopg can compare, or as None to turn
preparing off; anything else is refused naming the option."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from apiary_site.settings import _postgres


def test_the_queue_s_statements_may_be_prepared_by_default():
    assert _postgres("postgres://u@h:5432/db")["OPTIONS"]["prepare_threshold"] == 5


@pytest.mark.parametrize(("given", "expected"), [("2", 2), ("none", None), ("off", None), ("", None)])
def test_a_threshold_in_the_url_is_a_number_or_none(given, expected):
    options = _postgres(f"postgres://u@h/db?prepare_threshold={given}&sslmode=require")["OPTIONS"]
    assert options["prepare_threshold"] == expected and options["sslmode"] == "require"


def test_a_threshold_that_is_not_a_number_is_refused_by_name():
    with pytest.raises(ImproperlyConfigured, match="prepare_threshold must be a whole number or none, got 'five'"):
        _postgres("postgres://u@h/db?prepare_threshold=five")
