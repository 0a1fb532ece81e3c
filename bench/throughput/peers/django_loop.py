"""DJ, one worker: the seed's double-checked loop, in Django.

The throughput benchmark (benches/throughput/peers/django.rs) starts one
process per worker, with the benchmark's PostgreSQL database in
BENCH_DATABASE_URL, and talks to it over stdin and stdout: the worker prints
`ready` once connected, drains the queue when it reads `go`, prints `done` as
soon as it has, then `counts <rows processed> <statements sent>`.
"""

import os
import sys
from urllib.parse import unquote, urlparse

import django
from django.conf import settings

url = urlparse(os.environ["BENCH_DATABASE_URL"])
settings.configure(
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(url.path.lstrip("/")),
            "USER": unquote(url.username or ""),
            "PASSWORD": unquote(url.password or ""),
            "HOST": url.hostname or "",
            "PORT": str(url.port or 5432),
        }
    },
    USE_TZ=True,
)
django.setup()

from django.db import connection, models, transaction  # noqa: E402 (after setup)


class Order(models.Model):
    """The benchmark's `orders` table, which Django does not manage."""

    id = models.BigAutoField(primary_key=True)
    shipped_at = models.DateTimeField(null=True)
    shipped_email_sent = models.BooleanField(default=False)
    priority = models.IntegerField()
    customer = models.TextField()
    total_cents = models.BigIntegerField()
    note = models.TextField()

    class Meta:
        app_label = "bench"
        db_table = "orders"
        managed = False


class Outbox(models.Model):
    id = models.BigAutoField(primary_key=True)
    order_id = models.BigIntegerField()
    body = models.TextField()

    class Meta:
        app_label = "bench"
        db_table = "outbox"
        managed = False


def send_pending_order_shipped_emails():
    """The seed's loop, word for word but for what it does with an order:
    here, write its outbox row and mark it done (`save()`, as the seed).
    Returns the orders processed and the transactions run."""
    processed = transactions = 0
    orders_to_email = Order.objects.filter(
        shipped_at__isnull=False,
        shipped_email_sent=False,
    )
    for order in orders_to_email:
        with transaction.atomic():
            transactions += 1
            for order in orders_to_email.filter(id=order.id).select_for_update(
                of=("self",), skip_locked=True
            ):
                Outbox.objects.create(order_id=order.id, body=f"Order {order.id} has shipped")
                order.shipped_email_sent = True
                order.save()
                processed += 1
    return processed, transactions


class StatementCounter:
    """Counts the statements Django executes (an execute wrapper)."""

    def __init__(self):
        self.statements = 0

    def __call__(self, execute, sql, params, many, context):
        self.statements += 1
        return execute(sql, params, many, context)


def flush_statistics():
    """PostgreSQL counts a connection's commits only once it flushes its
    statistics: the benchmark reads them around the drain."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")


def main():
    connection.ensure_connection()
    flush_statistics()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    counter = StatementCounter()
    with connection.execute_wrapper(counter):
        processed, transactions = send_pending_order_shipped_emails()
    print("done", flush=True)
    flush_statistics()
    # psycopg sends each block's BEGIN and COMMIT itself, not through Django
    # (every block here executes its locking read).
    statements = counter.statements + 2 * transactions
    print(f"counts {processed} {statements}", flush=True)


main()
