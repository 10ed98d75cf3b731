//! The confirms of one channel, polled only when lapin wakes them.
//!
//! Every confirm gets a waker of its own that records its tag in a shared queue when
//! lapin resolves it; a round polls the new confirms and those in the queue. Because
//! lapin resolves confirms one after another on its own thread and wakes each right
//! after resolving it, any confirm resolved before one this task has seen is in the
//! queue (or new) by the time the next round takes it: the ordering the engine's
//! two-round certification relies on (see `engine.rs`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use lapin::{Confirmation, PublisherConfirm};

use crate::engine::Tag;

#[derive(Default)]
struct Shared {
    woken: Mutex<Vec<Tag>>,
    parent: AtomicWaker,
}

struct ConfirmWaker {
    tag: Tag,
    shared: Arc<Shared>,
}

impl Wake for ConfirmWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Ok(mut woken) = self.shared.woken.lock() {
            woken.push(self.tag);
        }
        self.shared.parent.wake();
    }
}

struct Entry {
    confirm: PublisherConfirm,
    waker: Waker,
}

/// The unresolved confirms of one channel.
#[derive(Default)]
pub(crate) struct ConfirmSet {
    shared: Arc<Shared>,
    entries: HashMap<Tag, Entry>,
    new: Vec<Tag>,
}

impl ConfirmSet {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn insert(&mut self, tag: Tag, confirm: PublisherConfirm) {
        let waker = Waker::from(Arc::new(ConfirmWaker {
            tag,
            shared: self.shared.clone(),
        }));
        self.entries.insert(tag, Entry { confirm, waker });
        self.new.push(tag);
    }

    /// Registers `cx` for wake-ups, then polls the new and the woken confirms and
    /// returns those that resolved.
    pub fn poll_resolved(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Vec<(Tag, lapin::Result<Confirmation>)> {
        self.shared.parent.register(cx.waker());
        let mut tags = std::mem::take(&mut self.new);
        if let Ok(mut woken) = self.shared.woken.lock() {
            tags.append(&mut woken);
        }
        let mut done = Vec::new();
        for tag in tags {
            let Some(entry) = self.entries.get_mut(&tag) else {
                continue;
            };
            let mut own = Context::from_waker(&entry.waker);
            if let Poll::Ready(result) = Pin::new(&mut entry.confirm).poll(&mut own) {
                self.entries.remove(&tag);
                done.push((tag, result));
            }
        }
        done
    }
}
