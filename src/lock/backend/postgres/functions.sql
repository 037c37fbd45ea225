-- The server-side functions of the PostgreSQL backend: see `schema.rs` (`FUNCTIONS`).
-- `{s}` is the schema, quoted; `{max_locks}`, `{schema_class}` and `{lock_class}` are numbers
-- filled in by `functions`.
-- Modes are stored as `mode_code` writes them: 0 shared, 1 exclusive, and any other code
-- `count` of `limit` permits, as the bits of `count << 32 | limit` (`(mode >> 32) & 4294967295`
-- and `mode & 4294967295` here). The rule, as `grant.rs` has it: a shared request meets only
-- shared rows ahead of it, an exclusive one none, and one of permits only permits, whose counts
-- with its own are at most the limit. An acquisition on a key where a live row is of the other
-- kind, or names another limit, is a misfit (`misfit_key`, `misfit_mode`: that row's key and
-- mode): refused, with nothing written.
-- The store's time is the server's clock less the forward steps of it that clients absorbed
-- (`meta.skew`; see `mod.rs`, "Time is the server's"). `check_clock` refuses a call whose
-- statement started later, by the store's time, than `p_latest`, the caller's latest estimate
-- of it (NULL: no estimate yet): the server's clock stepped forward, and nothing is decided on
-- it. The error (SQLSTATE LH001) says the skew it read and by how much the start was late; the
-- caller absorbs the step and calls again. It returns the skew, by which the caller reads the
-- store's time.
CREATE OR REPLACE FUNCTION {s}.check_clock(p_latest bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    seen bigint;
    late bigint;
BEGIN
    SELECT skew INTO seen FROM {s}.meta WHERE id = 1;
    late := (extract(epoch FROM statement_timestamp()) * 1000000)::bigint - seen - p_latest;
    IF late > 0 THEN
        RAISE EXCEPTION 'the server''s clock stepped forward: the call started % µs later than '
                        'its caller could expect', late
            USING ERRCODE = 'LH001', DETAIL = seen::text || ' ' || late::text;
    END IF;
    RETURN seen;
END $$;

CREATE OR REPLACE FUNCTION {s}.lock_keys(p_locks int4[], p_schema_lock int4, p_latest bigint)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    l int4;
    seen bigint := {s}.check_clock(p_latest);
BEGIN
    IF cardinality(p_locks) > {max_locks} THEN
        PERFORM pg_advisory_xact_lock({schema_class}, p_schema_lock);
    ELSE
        PERFORM pg_advisory_xact_lock_shared({schema_class}, p_schema_lock);
        FOREACH l IN ARRAY p_locks LOOP
            PERFORM pg_advisory_xact_lock({lock_class}, l);
        END LOOP;
    END IF;
    RETURN (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - seen;
END $$;

-- A batch of acquisitions and releases of one owner, decided in order in one transaction: the
-- locks of all their keys taken once, the time read afresh for each. The n-th operation's keys
-- (and modes, operations) are p_keys[p_ends[n-1] + 1 : p_ends[n]]; a release has a ticket, an
-- acquisition none, and a wait (0: queued, 1: unqueued, 2: not at all). One answer per
-- operation, in order: `now`, then
-- - for an acquisition: `ticket` (if rows were written), `granted`, and when it refused a
--   caller who waits, the other owners' live rows on its keys (`others_keys` and
--   `others_expiries`: when each key may be freed without anyone writing);
-- - for a release: the rows it `deleted`, how many of them were `live`, whether it `freed`
--   anything, the tickets it `promoted`, whoever owns them, and the other `owners` of those.
-- The other columns are left as they were: what they hold means nothing.
-- An operation whose `p_announce` is true is announced whenever it changes its keys (an
-- acquisition granted, a release that deleted rows), whoever waits: a leadership, which
-- observers watch without waiting. Otherwise only a release that may free another owner's
-- waiter is.
--
-- Written for speed: PL/pgSQL compiles each expression once per transaction, so an operation
-- alone in its call pays for every expression it meets (hence no resetting of the answer's
-- columns); each operation's part of the arrays is copied into variables once; and the
-- uncontended cases are one statement each: an acquisition on keys without rows, and a release
-- that leaves no other live row on its keys.
CREATE OR REPLACE FUNCTION {s}.decide(
    p_owner text, p_lease bigint, p_locks int4[], p_schema_lock int4, p_channel text,
    p_ends int4[], p_tickets int8[], p_waits int2[], p_all_keys text[], p_payloads text[],
    p_keys text[], p_modes int8[], p_operations text[], p_latest bigint, p_announce boolean[])
RETURNS TABLE (
    now bigint, ticket bigint, granted boolean, others_keys text[], others_expiries int8[],
    deleted bigint, live bigint, freed boolean, promoted int8[], owners text[],
    misfit_key text, misfit_mode bigint)
LANGUAGE plpgsql AS $$
DECLARE
    n int;
    lo int := 1;
    op_keys text[];
    op_modes int8[];
    op_ticket int8;
    op_wait int2;
    lapsed bigint;
    blocked boolean;
    others_left boolean;
    waited_for boolean;
    seen bigint := {s}.check_clock(p_latest);
BEGIN
    PERFORM {s}.lock_keys(p_locks, p_schema_lock, NULL);
    FOR n IN 1 .. coalesce(cardinality(p_ends), 0) LOOP
        op_keys := p_keys[lo:p_ends[n]];
        op_modes := p_modes[lo:p_ends[n]];
        op_ticket := p_tickets[n];
        op_wait := p_waits[n];
        now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - seen;
        IF op_ticket IS NULL THEN
            -- An acquisition on keys without rows (the uncontended case): granted.
            INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                   acquired_at, expires_at, heartbeat_at)
            SELECT r.key, r.mode, r.operation, p_owner, t.ticket, true, now, now,
                   now + p_lease, now
            FROM (SELECT nextval('{s}.tickets') AS ticket
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.locks AS o WHERE o.key = ANY(op_keys)))
                 AS t,
                 unnest(op_keys, op_modes, p_operations[lo:p_ends[n]]) AS r(key, mode, operation);
            IF FOUND THEN
                ticket := currval('{s}.tickets');
                granted := true;
                IF p_announce[n] THEN
                    PERFORM pg_notify(p_channel, p_payloads[n]);
                END IF;
                RETURN NEXT;
                lo := p_ends[n] + 1;
                CONTINUE;
            END IF;
            -- Any other acquisition: the keys' lapsed rows deleted; granted unless a live row there
            -- conflicts; rows written under a new ticket if granted or queued. Refused, it
            -- answers when the other owners' live rows there run out, and a caller without a
            -- queue position is noted in `watchers`.
            SELECT count(*) FILTER (WHERE o.expires_at <= now),
                   bool_or(o.expires_at > now AND (r.mode <> 0 OR o.mode <> 0))
            INTO lapsed, blocked
            FROM {s}.locks AS o
            JOIN unnest(op_keys, op_modes) AS r(key, mode) ON o.key = r.key;
            IF lapsed > 0 THEN
                DELETE FROM {s}.locks AS d WHERE d.key = ANY(op_keys) AND d.expires_at <= now;
                -- The read above may predate a renewal of a row it found lapsed that had not
                -- committed yet: the deletion waited for that renewal and left the row it
                -- renewed, so judge the keys again as they are now. (Judged on the first read,
                -- the key went to a second holder while the first went on renewing it.)
                SELECT bool_or(o.expires_at > now AND (r.mode <> 0 OR o.mode <> 0))
                INTO blocked
                FROM {s}.locks AS o
                JOIN unnest(op_keys, op_modes) AS r(key, mode) ON o.key = r.key;
            END IF;
            granted := NOT coalesce(blocked, false);
            IF NOT granted THEN
                -- A live row of the other kind, or of permits with another limit: a misfit.
                SELECT o.key, o.mode INTO misfit_key, misfit_mode
                FROM {s}.locks AS o JOIN unnest(op_keys, op_modes) AS r(key, mode) ON o.key = r.key
                WHERE o.expires_at > now
                  AND ((r.mode IN (0, 1)) <> (o.mode IN (0, 1))
                       OR (r.mode NOT IN (0, 1) AND o.mode NOT IN (0, 1)
                           AND (o.mode & 4294967295) <> (r.mode & 4294967295)))
                LIMIT 1;
                IF misfit_key IS NOT NULL THEN
                    ticket := NULL;
                    RETURN NEXT;
                    lo := p_ends[n] + 1;
                    CONTINUE;
                END IF;
                -- Any live row blocks a request of permits by the test above; judge it by the
                -- counts, key by key, where there are such requests.
                IF EXISTS (SELECT 1 FROM unnest(op_modes) AS m WHERE m NOT IN (0, 1)) THEN
                    SELECT NOT coalesce(bool_or(k.blocked), false) INTO granted FROM (
                        SELECT CASE WHEN r.mode IN (0, 1) THEN bool_or(r.mode <> 0 OR o.mode <> 0)
                                    ELSE sum((o.mode >> 32) & 4294967295)
                                         + ((r.mode >> 32) & 4294967295) > (r.mode & 4294967295)
                               END AS blocked
                        FROM unnest(op_keys, op_modes) AS r(key, mode)
                        JOIN {s}.locks AS o ON o.key = r.key AND o.expires_at > now
                        GROUP BY r.key, r.mode) AS k;
                END IF;
            END IF;
            IF NOT granted AND op_wait <> 2 THEN
                SELECT array_agg(o.key), array_agg(o.expires_at)
                INTO others_keys, others_expiries
                FROM {s}.locks AS o
                WHERE o.key = ANY(op_keys) AND o.expires_at > now AND o.owner <> p_owner;
                IF op_wait = 1 THEN
                    INSERT INTO {s}.watchers AS w (key, owner, expires_at)
                    SELECT k, p_owner, now + 2 * p_lease FROM unnest(op_keys) AS k
                    ON CONFLICT (key, owner) DO UPDATE SET expires_at = EXCLUDED.expires_at;
                END IF;
            END IF;
            ticket := CASE WHEN granted OR op_wait = 0 THEN nextval('{s}.tickets') END;
            IF ticket IS NOT NULL THEN
                INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                       acquired_at, expires_at, heartbeat_at, keys)
                SELECT r.key, r.mode, r.operation, p_owner, ticket, granted, now,
                       CASE WHEN granted THEN now END, now + p_lease, now,
                       CASE WHEN NOT granted THEN p_all_keys[n] END
                FROM unnest(op_keys, op_modes, p_operations[lo:p_ends[n]])
                     AS r(key, mode, operation);
            END IF;
            IF granted AND p_announce[n] THEN
                PERFORM pg_notify(p_channel, p_payloads[n]);
            END IF;
        ELSE
            -- A release: the owner's rows of the ticket deleted, with the keys' lapsed rows;
            -- then, if other live rows are left there, the single-key waiters that the rule now
            -- lets through promoted. (A release of the only rows on its keys, the uncontended
            -- case, is this one statement.)
            -- The statement's reads predate a renewal in flight of a row they find lapsed:
            -- the deletion waits for that renewal and leaves the row it renewed. Such a row
            -- (read lapsed, not deleted) counts as live here, and the promotion, a statement
            -- of its own, judges it as it is now. (Counted lapsed, a waiter renewed just in
            -- time was neither promoted nor told, and waited for the holder's whole lease.)
            WITH d AS (
                DELETE FROM {s}.locks AS d
                WHERE d.key = ANY(op_keys)
                  AND ((d.ticket = op_ticket AND d.owner = p_owner) OR d.expires_at <= now)
                RETURNING d.key, d.ticket, d.ticket = op_ticket AND d.owner = p_owner AS own,
                          d.expires_at > now AS live)
            SELECT count(*) FILTER (WHERE d.own), count(*) FILTER (WHERE d.own AND d.live),
                   count(*) FILTER (WHERE NOT d.own),
                   EXISTS (SELECT 1 FROM {s}.locks AS o
                           WHERE o.key = ANY(op_keys)
                             AND (o.ticket <> op_ticket OR o.owner <> p_owner)
                             AND (o.expires_at > now OR NOT EXISTS (
                                 SELECT 1 FROM d AS g WHERE g.key = o.key AND g.ticket = o.ticket))),
                   EXISTS (SELECT 1 FROM {s}.locks AS w
                           WHERE w.key = ANY(op_keys) AND NOT w.held AND w.owner <> p_owner
                             AND (w.expires_at > now OR NOT EXISTS (
                                 SELECT 1 FROM d AS g WHERE g.key = w.key AND g.ticket = w.ticket)))
                   OR EXISTS (SELECT 1 FROM {s}.watchers AS w
                              WHERE w.key = ANY(op_keys) AND w.expires_at > now
                                AND w.owner <> p_owner)
            INTO deleted, live, lapsed, others_left, waited_for FROM d;
            promoted := NULL;
            owners := NULL;
            IF others_left THEN
                WITH p AS (
                    UPDATE {s}.locks AS w SET held = true, acquired_at = now,
                        expires_at = GREATEST(w.expires_at, now + (w.expires_at - w.heartbeat_at)),
                        heartbeat_at = GREATEST(w.heartbeat_at, now)
                    WHERE w.key = ANY(op_keys) AND NOT w.held AND w.keys IS NULL
                      AND w.expires_at > now
                      AND CASE WHEN w.mode IN (0, 1) THEN NOT EXISTS (
                          SELECT 1 FROM {s}.locks AS o
                          WHERE o.key = w.key AND o.ticket < w.ticket AND o.expires_at > now
                            AND (w.mode <> 0 OR o.mode <> 0))
                      ELSE (
                          SELECT NOT coalesce(bool_or(o.mode IN (0, 1)), false)
                                 AND coalesce(sum((o.mode >> 32) & 4294967295), 0)
                                     + ((w.mode >> 32) & 4294967295)
                                     <= LEAST(w.mode & 4294967295,
                                              coalesce(min(o.mode & 4294967295),
                                                       w.mode & 4294967295))
                          FROM {s}.locks AS o
                          WHERE o.key = w.key AND o.ticket < w.ticket AND o.expires_at > now)
                      END
                    RETURNING w.ticket, w.owner)
                SELECT array_agg(p.ticket),
                       array_agg(DISTINCT p.owner) FILTER (WHERE p.owner <> p_owner)
                INTO promoted, owners FROM p;
            END IF;
            freed := deleted > 0 OR lapsed > 0 OR promoted IS NOT NULL;
            -- Announced only if another owner may be waiting: its request promoted, or it
            -- waited before (a waiting row, promoted since or not, or a caller without a row,
            -- in `watchers`). This owner learns of its own promotions from the answer, and
            -- looks for itself at the keys where a request of its own on several keys waits.
            IF freed AND (p_announce[n] OR owners IS NOT NULL OR waited_for) THEN
                PERFORM pg_notify(p_channel, p_payloads[n]);
            END IF;
        END IF;
        RETURN NEXT;
        lo := p_ends[n] + 1;
    END LOOP;
END $$;

-- A heartbeat of one owner in one round trip: the schema's lock taken shared (as by every
-- transaction on a few keys), then every row of the owner locked in key order (as promotions
-- change rows, so that the two never deadlock), the time read once all are held, and the rows
-- live by that time renewed until a lease from it: a row that ran out while the call waited for
-- it stays out, since a decision may have passed over it. Then the sweep of every owner's
-- lapsed rows and watchers, and of the tombstones of removals past their time, skipping rows another transaction holds (it never waits for them,
-- so it never deadlocks with a decision). One answer: the time, and the renewed rows' tickets
-- and states, in key order (NULL when none).
CREATE OR REPLACE FUNCTION {s}.renew(
    p_owner text, p_lease bigint, p_schema_lock int4, p_latest bigint)
RETURNS TABLE (now bigint, tickets int8[], helds boolean[])
LANGUAGE plpgsql AS $$
DECLARE
    seen bigint := {s}.check_clock(p_latest);
BEGIN
    PERFORM {s}.lock_keys('{}'::int4[], p_schema_lock, NULL);
    PERFORM 1 FROM {s}.locks AS l WHERE l.owner = p_owner ORDER BY l.key, l.ticket FOR UPDATE;
    now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - seen;
    WITH r AS (
        UPDATE {s}.locks AS l SET expires_at = now + p_lease, heartbeat_at = now
        WHERE l.owner = p_owner AND l.expires_at > now
        RETURNING l.key, l.ticket, l.held)
    SELECT array_agg(r.ticket ORDER BY r.key, r.ticket),
           array_agg(r.held ORDER BY r.key, r.ticket)
    INTO tickets, helds FROM r;
    DELETE FROM {s}.locks WHERE ctid IN (
        SELECT ctid FROM {s}.locks WHERE expires_at - 0 <= now FOR UPDATE SKIP LOCKED);
    DELETE FROM {s}.watchers WHERE ctid IN (
        SELECT ctid FROM {s}.watchers WHERE expires_at - 0 <= now FOR UPDATE SKIP LOCKED);
    DELETE FROM {s}.removed WHERE ctid IN (
        SELECT ctid FROM {s}.removed WHERE kept_until - 0 <= now FOR UPDATE SKIP LOCKED);
    RETURN NEXT;
END $$;

-- The commonest calls of `decide`, an operation alone on one key, each in a function of its own:
-- the same statements, decided the same way, with scalars for arrays and one row of OUT
-- parameters (in `decide`'s columns and order) for a table, so that the server does less
-- around them (about half of `decide`'s time for such a call). `acquire_one` is `decide` for
-- one acquisition of one key, `release_one` for one release of a request on one key; their
-- answers mean what `decide`'s do. Their statements are copies of `decide`'s, not calls of
-- shared functions, since a nested call is the cost they save: a change to one is made to the
-- other, and the property test `an_operation_on_one_key_is_decided_by_its_function_as_by_decide`
-- (`tests.rs`) compares every answer, row and announcement of the two.
CREATE OR REPLACE FUNCTION {s}.acquire_one(
    p_owner text, p_lease bigint, p_lock int4, p_schema_lock int4, p_key text, p_mode int8,
    p_operation text, p_wait int2, p_latest bigint, p_channel text, p_payload text,
    OUT now bigint, OUT ticket bigint, OUT granted boolean, OUT others_keys text[],
    OUT others_expiries int8[], OUT deleted bigint, OUT live bigint, OUT freed boolean,
    OUT promoted int8[], OUT owners text[], OUT misfit_key text, OUT misfit_mode bigint)
LANGUAGE plpgsql AS $$
DECLARE
    lapsed bigint;
    blocked boolean;
    seen bigint := {s}.check_clock(p_latest);
BEGIN
    PERFORM pg_advisory_xact_lock_shared({schema_class}, p_schema_lock);
    PERFORM pg_advisory_xact_lock({lock_class}, p_lock);
    now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - seen;
    -- On a key without rows (the uncontended case): granted.
    INSERT INTO {s}.locks AS l (key, mode, operation, owner, ticket, held, requested_at,
                                acquired_at, expires_at, heartbeat_at)
    SELECT p_key, p_mode, p_operation, p_owner, nextval('{s}.tickets'), true, now, now,
           now + p_lease, now
    WHERE NOT EXISTS (SELECT 1 FROM {s}.locks AS o WHERE o.key = p_key)
    RETURNING l.ticket INTO ticket;
    IF FOUND THEN
        granted := true;
        -- Announced as `decide` announces an acquisition: if asked (a payload given).
        IF p_payload IS NOT NULL THEN
            PERFORM pg_notify(p_channel, p_payload);
        END IF;
        RETURN;
    END IF;
    -- As `decide` does: the lapsed rows deleted, and the key judged again after it.
    SELECT count(*) FILTER (WHERE o.expires_at <= now),
           bool_or(o.expires_at > now AND (p_mode <> 0 OR o.mode <> 0))
    INTO lapsed, blocked
    FROM {s}.locks AS o WHERE o.key = p_key;
    IF lapsed > 0 THEN
        DELETE FROM {s}.locks AS d WHERE d.key = p_key AND d.expires_at <= now;
        SELECT bool_or(o.expires_at > now AND (p_mode <> 0 OR o.mode <> 0))
        INTO blocked
        FROM {s}.locks AS o WHERE o.key = p_key;
    END IF;
    granted := NOT coalesce(blocked, false);
    IF NOT granted THEN
        SELECT o.key, o.mode INTO misfit_key, misfit_mode FROM {s}.locks AS o
        WHERE o.key = p_key AND o.expires_at > now
          AND ((p_mode IN (0, 1)) <> (o.mode IN (0, 1))
               OR (p_mode NOT IN (0, 1) AND o.mode NOT IN (0, 1)
                   AND (o.mode & 4294967295) <> (p_mode & 4294967295)))
        LIMIT 1;
        IF misfit_key IS NOT NULL THEN
            RETURN;
        END IF;
        IF p_mode NOT IN (0, 1) THEN
            SELECT coalesce(sum((o.mode >> 32) & 4294967295), 0) + ((p_mode >> 32) & 4294967295)
                   <= (p_mode & 4294967295)
            INTO granted
            FROM {s}.locks AS o WHERE o.key = p_key AND o.expires_at > now;
        END IF;
    END IF;
    IF NOT granted AND p_wait <> 2 THEN
        SELECT array_agg(o.key), array_agg(o.expires_at)
        INTO others_keys, others_expiries
        FROM {s}.locks AS o
        WHERE o.key = p_key AND o.expires_at > now AND o.owner <> p_owner;
        IF p_wait = 1 THEN
            INSERT INTO {s}.watchers AS w (key, owner, expires_at)
            VALUES (p_key, p_owner, now + 2 * p_lease)
            ON CONFLICT (key, owner) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        END IF;
    END IF;
    IF granted OR p_wait = 0 THEN
        ticket := nextval('{s}.tickets');
        INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                               acquired_at, expires_at, heartbeat_at)
        VALUES (p_key, p_mode, p_operation, p_owner, ticket, granted, now,
                CASE WHEN granted THEN now END, now + p_lease, now);
    END IF;
    IF granted AND p_payload IS NOT NULL THEN
        PERFORM pg_notify(p_channel, p_payload);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION {s}.release_one(
    p_owner text, p_lock int4, p_schema_lock int4, p_channel text, p_key text, p_ticket bigint,
    p_payload text, p_latest bigint, p_announce boolean,
    OUT now bigint, OUT ticket bigint, OUT granted boolean, OUT others_keys text[],
    OUT others_expiries int8[], OUT deleted bigint, OUT live bigint, OUT freed boolean,
    OUT promoted int8[], OUT owners text[], OUT misfit_key text, OUT misfit_mode bigint)
LANGUAGE plpgsql AS $$
DECLARE
    lapsed bigint;
    others_left boolean;
    waited_for boolean := false;
    seen bigint := {s}.check_clock(p_latest);
BEGIN
    PERFORM pg_advisory_xact_lock_shared({schema_class}, p_schema_lock);
    PERFORM pg_advisory_xact_lock({lock_class}, p_lock);
    now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - seen;
    -- As in `decide`, a row read lapsed that the deletion left (renewed meanwhile) counts.
    WITH d AS (
        DELETE FROM {s}.locks AS d
        WHERE d.key = p_key
          AND ((d.ticket = p_ticket AND d.owner = p_owner) OR d.expires_at <= now)
        RETURNING d.ticket, d.ticket = p_ticket AND d.owner = p_owner AS own,
                  d.expires_at > now AS live)
    SELECT count(*) FILTER (WHERE d.own), count(*) FILTER (WHERE d.own AND d.live),
           count(*) FILTER (WHERE NOT d.own),
           EXISTS (SELECT 1 FROM {s}.locks AS o
                   WHERE o.key = p_key AND (o.ticket <> p_ticket OR o.owner <> p_owner)
                     AND (o.expires_at > now
                          OR NOT EXISTS (SELECT 1 FROM d AS g WHERE g.ticket = o.ticket)))
    INTO deleted, live, lapsed, others_left FROM d;
    -- A waiting row is a live row: with no other live row left on the key (the uncontended
    -- case) there is none to promote, and none to announce to. The statements from here read
    -- afresh.
    IF others_left THEN
        waited_for := EXISTS (SELECT 1 FROM {s}.locks AS w
                              WHERE w.key = p_key AND NOT w.held AND w.expires_at > now
                                AND w.owner <> p_owner);
        WITH p AS (
            UPDATE {s}.locks AS w SET held = true, acquired_at = now,
                expires_at = GREATEST(w.expires_at, now + (w.expires_at - w.heartbeat_at)),
                heartbeat_at = GREATEST(w.heartbeat_at, now)
            WHERE w.key = p_key AND NOT w.held AND w.keys IS NULL AND w.expires_at > now
              AND CASE WHEN w.mode IN (0, 1) THEN NOT EXISTS (
                  SELECT 1 FROM {s}.locks AS o
                  WHERE o.key = w.key AND o.ticket < w.ticket AND o.expires_at > now
                    AND (w.mode <> 0 OR o.mode <> 0))
              ELSE (
                  SELECT NOT coalesce(bool_or(o.mode IN (0, 1)), false)
                         AND coalesce(sum((o.mode >> 32) & 4294967295), 0)
                             + ((w.mode >> 32) & 4294967295)
                             <= LEAST(w.mode & 4294967295,
                                      coalesce(min(o.mode & 4294967295), w.mode & 4294967295))
                  FROM {s}.locks AS o
                  WHERE o.key = w.key AND o.ticket < w.ticket AND o.expires_at > now)
              END
            RETURNING w.ticket, w.owner)
        SELECT array_agg(p.ticket),
               array_agg(DISTINCT p.owner) FILTER (WHERE p.owner <> p_owner)
        INTO promoted, owners FROM p;
    END IF;
    freed := deleted > 0 OR lapsed > 0 OR promoted IS NOT NULL;
    -- Announced as `decide` announces: if asked, or if another owner may be waiting.
    IF freed AND (p_announce OR owners IS NOT NULL OR waited_for
                  OR EXISTS (SELECT 1 FROM {s}.watchers AS w
                             WHERE w.key = p_key AND w.expires_at > now
                               AND w.owner <> p_owner)) THEN
        PERFORM pg_notify(p_channel, p_payload);
    END IF;
END $$;
