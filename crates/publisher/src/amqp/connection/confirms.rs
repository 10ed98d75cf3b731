//! The one owner of delivery tags (docs/design.md §4, "Delivery tags"): the
//! connection numbers a confirm-mode channel's publishes as the broker does (from 1),
//! and turns each `basic.ack` / `basic.nack` into one confirm per tag, in ascending
//! order, each tag exactly once. The engine takes the broker's tags as they are:
//! no other place in the relay translates or counts them.

use std::collections::VecDeque;

/// A confirm that names a tag the channel never published, or one confirmed
/// already: the broker and the relay disagree about the channel, which no retry
/// on the same channel can mend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TagError(pub String);

/// The delivery tags of one confirm-mode channel.
#[derive(Debug)]
pub(crate) struct Tags {
    /// The lowest tag not confirmed yet (tags start at 1).
    first: u64,
    /// Whether each tag from `first` on is confirmed.
    done: VecDeque<bool>,
    /// Tags published and not confirmed.
    unconfirmed: usize,
}

impl Default for Tags {
    fn default() -> Self {
        Tags {
            first: 1,
            done: VecDeque::new(),
            unconfirmed: 0,
        }
    }
}

impl Tags {
    /// The tag the next publish gets.
    pub(crate) fn next(&self) -> u64 {
        self.first + self.done.len() as u64
    }

    /// Records a publish; returns its tag.
    pub(crate) fn publish(&mut self) -> u64 {
        let tag = self.next();
        self.done.push_back(false);
        self.unconfirmed += 1;
        tag
    }

    /// Publishes not confirmed yet.
    pub(crate) fn unconfirmed(&self) -> usize {
        self.unconfirmed
    }

    /// The tags one confirm settles, in ascending order: `tag` alone, or with
    /// `multiple` every tag up to it not confirmed yet. A `multiple` confirm may
    /// cover tags confirmed singly before; a single confirm of a tag confirmed
    /// already, or of a tag never published, is an error.
    pub(crate) fn settle(
        &mut self,
        tag: u64,
        multiple: bool,
        mut each: impl FnMut(u64),
    ) -> Result<(), TagError> {
        // `multiple` with tag 0 means "all outstanding" as the *broker* sees them
        // (AMQP 0-9-1 `basic.ack`): which of the relay's publishes it had read is
        // unknowable, so it confirms nothing, as in the Java and Go clients. A
        // broker that meant it is then a broker whose confirms are overdue
        // (`request_timeout`): the messages go again on a new connection, never lost.
        if tag == 0 && multiple {
            return Ok(());
        }
        if tag >= self.next() || tag == 0 {
            return Err(TagError(format!(
                "the broker confirmed delivery tag {tag}, which was never published on the channel (the last is {})",
                self.next() - 1
            )));
        }
        if tag < self.first {
            if multiple {
                return Ok(());
            }
            return Err(TagError(format!(
                "the broker confirmed delivery tag {tag} twice"
            )));
        }
        let from = if multiple { self.first } else { tag };
        for t in from..=tag {
            let slot = &mut self.done[(t - self.first) as usize];
            if !*slot {
                *slot = true;
                self.unconfirmed -= 1;
                each(t);
            } else if !multiple {
                return Err(TagError(format!(
                    "the broker confirmed delivery tag {tag} twice"
                )));
            }
        }
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.first += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Tags;

    fn settled(t: &mut Tags, tag: u64, multiple: bool) -> Result<Vec<u64>, String> {
        let mut tags = Vec::new();
        t.settle(tag, multiple, |x| tags.push(x)).map_err(|e| e.0)?;
        Ok(tags)
    }

    #[test]
    fn confirms_settle_each_tag_once_in_order() {
        let mut t = Tags::default();
        for expected in 1..=6 {
            assert_eq!(t.publish(), expected);
        }
        assert_eq!(settled(&mut t, 3, false).unwrap(), [3]);
        assert_eq!(settled(&mut t, 4, true).unwrap(), [1, 2, 4]);
        assert_eq!(t.unconfirmed(), 2);
        // A multiple confirm below the front settles nothing, and is fine.
        assert_eq!(settled(&mut t, 2, true).unwrap(), Vec::<u64>::new());
        assert_eq!(settled(&mut t, 6, true).unwrap(), [5, 6]);
        assert_eq!(t.unconfirmed(), 0);
        assert_eq!(t.next(), 7);
    }

    /// Tag 0 with `multiple` ("all outstanding" as the broker sees them) is not an
    /// error and confirms nothing: the publishes it may mean are confirmed later or
    /// sent again, never credited unread (issue 49).
    #[test]
    fn a_multiple_confirm_of_tag_zero_is_no_error_and_confirms_nothing() {
        let mut t = Tags::default();
        assert_eq!(settled(&mut t, 0, true).unwrap(), Vec::<u64>::new());
        for _ in 0..4 {
            t.publish();
        }
        assert_eq!(settled(&mut t, 2, false).unwrap(), [2]);
        assert_eq!(settled(&mut t, 0, true).unwrap(), Vec::<u64>::new());
        assert_eq!(t.unconfirmed(), 3);
        assert_eq!(settled(&mut t, 4, true).unwrap(), [1, 3, 4]);
    }

    #[test]
    fn a_tag_never_published_or_confirmed_twice_is_an_error() {
        let mut t = Tags::default();
        t.publish();
        t.publish();
        assert!(settled(&mut t, 3, false)
            .unwrap_err()
            .contains("never published"));
        assert!(settled(&mut t, 3, true)
            .unwrap_err()
            .contains("never published"));
        assert!(settled(&mut t, 0, false).is_err());
        assert_eq!(settled(&mut t, 2, false).unwrap(), [2]);
        assert!(settled(&mut t, 2, false).unwrap_err().contains("twice"));
        assert_eq!(settled(&mut t, 1, false).unwrap(), [1]);
        assert!(settled(&mut t, 1, false).unwrap_err().contains("twice"));
    }
}
