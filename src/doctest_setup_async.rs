// Shared by the async documentation examples: the shop's `orders` without
// `diesel::prelude`, whose `RunQueryDsl` would clash with diesel-async's.
diesel::table! {
    orders (id) {
        id -> Integer,
        shipped -> Bool,
        email_sent -> Bool,
    }
}

#[derive(Debug, diesel::Queryable, diesel::Selectable, diesel::Identifiable)]
#[diesel(table_name = orders)]
pub struct Order {
    pub id: i32,
    pub shipped: bool,
    pub email_sent: bool,
}

type MyError = diesel_claim::Error;

async fn send_shipped_email(_order: &Order) -> Result<(), MyError> {
    Ok(())
}
