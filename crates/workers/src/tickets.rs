//! The ticket worker (design §11): on TicketIssueRequested for a `paid` order (a replay finds
//! it `ticketed` and changes nothing), in one transaction, releases the hold rows and inserts
//! one ticket for each seat they gave back (the ticket now owns the seat), with an id derived
//! from (order, seat) and insert-or-nothing; moves the order to `ticketed` and emits
//! TicketIssued. A confirmed hold is never released because issuance is slow: a failed
//! attempt rolls back and is retried (invariant 1: one ticket per seat). Followed through in
//! the capture's transaction when the process runs it beside the payment worker and the saga
//! (`boxoffice_bus::follow`); a failure there rolls that transaction back and leaves the
//! request to this worker's consumer, so the capture is never held back by issuance.

use async_trait::async_trait;
use boxoffice_bus::{Handler, HandlerError};
use boxoffice_domain::{Envelope, EventKind, HoldStatus, OrderId, OrderStatus, PurchaseEvent};
use boxoffice_store::holds::HoldRow;
use boxoffice_store::orders::OrderRow;
use boxoffice_store::{holds, orders, tickets, Tx};

/// The ticket consumer.
#[derive(Debug, Default, Clone)]
pub struct TicketWorker;

/// Consumer name (inbox key, consumer group `ticketing-tickets`).
pub const NAME: &str = boxoffice_domain::consumers::TICKETS;

#[async_trait]
impl Handler for TicketWorker {
    type Prepared = ();
    type Precheck = ();

    fn name(&self) -> &'static str {
        NAME
    }

    fn wants(&self, kind: EventKind) -> bool {
        kind == EventKind::TicketIssueRequested
    }

    /// A message on the purchase topic that is no envelope is the saga's group's to
    /// dead-letter (one copy, not one per group).
    fn dead_letters_unreadable(&self) -> bool {
        false
    }

    /// Every request read from the bus: one this ledger did not write is parked, and leaves
    /// its id to the real one.
    fn verifies(&self, _event: &PurchaseEvent) -> bool {
        true
    }

    async fn prepare(&self, _: &Envelope, _: &PurchaseEvent, _: ()) -> Result<(), HandlerError> {
        Ok(())
    }

    type Rows = Option<(HoldRow, OrderRow)>;

    /// Every order's hold and order, locked in one statement ([`holds::lock_each_with_order`]);
    /// `None` for an order without a hold and for a second request of an order.
    async fn lock_rows(
        &self,
        tx: &mut Tx<'_>,
        run: &[(&Envelope, &PurchaseEvent)],
    ) -> Result<Vec<Self::Rows>, HandlerError> {
        let orders: Vec<OrderId> = run.iter().map(|(_, e)| e.order_id()).collect();
        Ok(holds::lock_each_with_order(tx, &orders).await?)
    }

    async fn apply(
        &self,
        tx: &mut Tx<'_>,
        env: &Envelope,
        event: &PurchaseEvent,
        _: (),
        rows: Self::Rows,
    ) -> Result<Vec<Envelope>, HandlerError> {
        let PurchaseEvent::TicketIssueRequested { order_id, hold_id } = event else {
            return Err(HandlerError::permanent("unexpected_event", anyhow::anyhow!("{}", env.event_type)));
        };
        let rows = match rows {
            Some((hold, order)) => Some((Some(hold), order)),
            None => holds::lock_with_order(tx, *order_id).await?,
        };
        let Some((hold, mut order)) = rows else {
            return Err(HandlerError::permanent("unknown_order", anyhow::anyhow!("order {order_id}")));
        };
        // The order's one hold is the request's, or the request names a hold it does not have.
        let hold = hold.filter(|h| h.id == hold_id.0);
        let status = order.status;
        if status != OrderStatus::Paid {
            tracing::info!(order.id = %order_id, status = %status, "ticket issue requested for an order that is not paid; nothing to do");
            return Ok(vec![]);
        }
        let Some(mut hold) = hold else {
            return Err(HandlerError::permanent("missing_hold", anyhow::anyhow!("hold {hold_id}")));
        };
        if hold.status != HoldStatus::Confirmed {
            return Err(HandlerError::permanent(
                "hold_not_confirmed",
                anyhow::anyhow!("hold {hold_id} is {}", hold.status),
            ));
        }
        // The hold gives its seats back and the tickets take them, in one transaction.
        let (_, seats) = holds::transition_returning_seats(tx, &mut hold, HoldStatus::Released).await?;
        let ids = tickets::issue(tx, *order_id, &seats, order.event_id).await?;
        orders::transition(tx, &mut order, OrderStatus::Ticketed, None).await?;
        metrics::counter!("boxoffice_tickets_issued_total").increment(ids.len() as u64);
        Ok(vec![env.follow(&PurchaseEvent::TicketIssued { order_id: *order_id, ticket_ids: ids })])
    }
}
