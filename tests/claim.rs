//! Claiming: each row at most once, across workers.

use diesel::prelude::*;
use diesel_claim::prelude::*;
use diesel_claim::{ClaimReport, Error};

use crate::fixtures::{on_every_backend, orders, outbox, Order};

on_every_backend! {
    #[test]
    fn smoke() {
        let (_db, pool) = test_db(2);
        let mut conn = pool.get().unwrap();
        diesel::insert_into(orders::table)
            .values(vec![orders::shipped.eq(true); 10])
            .execute(&mut conn)
            .unwrap();
        let pending = orders::table.filter(orders::shipped.eq(true)).filter(orders::email_sent.eq(false));
        let report = pending.claim_each(&mut conn, |conn, order: Order| {
            diesel::update(&order).set(orders::email_sent.eq(true)).execute(conn)?;
            diesel::insert_into(outbox::table)
                .values((outbox::order_id.eq(order.id), outbox::worker.eq(0)))
                .execute(conn)?;
            Ok::<_, Error>(())
        }).unwrap();
        assert_eq!((report.processed, report.skipped), (10, 0));
        let again: ClaimReport = pending.claim_each(&mut conn, |_, _: Order| Ok::<_, Error>(())).unwrap();
        assert_eq!(again.processed, 0);
    }
}
