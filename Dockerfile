# celery-ledger runtime image: the library, the reference app (`celery -A tasks`) and Flower.
# No secrets are baked in: every credential comes from the environment at run time
# (see docker-compose.yml and .env.example).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # `tasks` is the app package and is not part of the installed distribution.
    PYTHONPATH=/app

RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /home/app --create-home \
       --shell /usr/sbin/nologin app \
    # Writable state (beat's schedule); everything else stays read-only for the app user.
    && install -d -o app -g app /var/lib/celery-ledger

WORKDIR /app

COPY pyproject.toml README.md LICENSE ./
COPY platform/ platform/
# The extras the compose file turns on: worker metrics, Sentry, OpenTelemetry traces.
RUN pip install ".[metrics,sentry,tracing,console]" "flower>=2.0,<3" && rm -rf build platform/*.egg-info

COPY tasks/ tasks/

USER app

# Services pick their command in docker-compose.yml, e.g. `celery -A tasks ledger worker --tier bulk`.
CMD ["celery", "-A", "tasks", "ledger", "--help"]
